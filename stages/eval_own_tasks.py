"""The run's own generated task as an lm-eval task: ``eval.tasks: [pipeline_task]`` (pipeline.schema.stage_sections
``OWN_LM_TASKS``), so the held-out task is scored on the same path as every benchmark.

``pipeline_task`` is a generate-until task over the first ``eval.num_task_examples`` held-out task prompts as the
run renders them (the eval stage's own ``task_accuracy`` examples, written to
``<eval stage dir>/lm_eval_tasks/pipeline_task.jsonl``): greedy answers of ``eval.max_new_tokens`` tokens up to a
stop token, checked by the task's program (``stages.tasks.is_correct``): metric ``acc``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.records.files import atomic_write_text
from pipeline.schema.config import PipelineConfig
from stages import tasks

FOLDER = "lm_eval_tasks"


def own_task_configs(out_dir: Path, sets: dict[str, Any], cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """``{name: lm-eval task config}`` of the run's own tasks named in ``eval.tasks`` (their documents written
    under ``out_dir``); empty when none is asked for."""
    if "pipeline_task" not in cfg.eval.tasks:
        return {}
    path = Path(out_dir) / FOLDER / "pipeline_task.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = [
        {"prompt": r["prompt"], "question": r.get("question"), "answer": r["answer"]} for r in sets["task"]
    ]
    atomic_write_text(path, "".join(json.dumps(d) + "\n" for d in docs))  # every job writes the same bytes
    return {
        "pipeline_task": {
            "task": "pipeline_task",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(path)}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": [], "max_gen_toks": cfg.eval.max_new_tokens, "do_sample": False},
            "process_results": checked,
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        }
    }


def checked(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval's process_results: the greedy answer checked by the task's program."""
    return {"acc": float(tasks.is_correct(results[0], doc["answer"]))}
