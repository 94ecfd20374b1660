"""The run's own held-out sets as lm-eval tasks: ``eval.tasks: [pipeline_task, pipeline_pref]``
(pipeline.schema.stage_sections ``OWN_LM_TASKS``), so they are scored on the same path as every benchmark.

- ``pipeline_task``: a generate-until task over the first ``eval.num_task_examples`` held-out task prompts as the
  run renders them (the eval stage's own ``task_accuracy`` examples): greedy answers of ``eval.max_new_tokens``
  tokens up to a stop token, checked by the task's program (``stages.tasks.is_correct``): metric ``acc``.
- ``pipeline_pref``: a multiple-choice task over the held-out preference pairs the stage scores for
  ``pref_accuracy`` (the rendered prompt as context, the chosen and the rejected reply as the two choices, the
  chosen one right, no delimiter between them): ``acc`` is the share of pairs whose chosen reply is the more
  likely, as ``pref_accuracy``; equal to it when no pair is cut at ``model.seq_length`` (lm-eval cuts the
  context on the left, the stage's rows cut the reply on the right).

Each task's documents are written to ``<eval stage dir>/lm_eval_tasks/<name>.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.records.files import atomic_write_text
from pipeline.schema.config import PipelineConfig
from stages import tasks

FOLDER = "lm_eval_tasks"
_VERSION = {"version": 1.0}


def own_task_configs(out_dir: Path, sets: dict[str, Any], cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """``{name: lm-eval task config}`` of the run's own tasks named in ``eval.tasks`` (their documents written
    under ``out_dir``); empty when none is asked for."""
    out = {}
    for name in cfg.eval.tasks:
        if name in OWN_TASKS:
            docs, config = OWN_TASKS[name](sets, cfg)
            path = Path(out_dir) / FOLDER / f"{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(json.dumps(d) + "\n" for d in docs))  # every job: the same bytes
            out[name] = {
                "task": name,
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(path)}},
                "test_split": "test",
                **config,
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                "metadata": _VERSION,
            }
    return out


def _task(sets: dict[str, Any], cfg: PipelineConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    docs = [
        {"prompt": r["prompt"], "question": r.get("question"), "answer": r["answer"]} for r in sets["task"]
    ]
    return docs, {
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": [], "max_gen_toks": cfg.eval.max_new_tokens, "do_sample": False},
        "process_results": checked,
    }


def _pref(sets: dict[str, Any], cfg: PipelineConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    docs = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in sets["pref_texts"]]
    return docs, {
        "output_type": "multiple_choice",
        "doc_to_text": "{{prompt}}",
        "doc_to_choice": choices,
        "doc_to_target": 0,
        "target_delimiter": "",
    }


def checked(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval's process_results: the greedy answer checked by the task's program."""
    return {"acc": float(tasks.is_correct(results[0], doc["answer"]))}


def choices(doc: dict[str, Any]) -> list[str]:
    """lm-eval's doc_to_choice: the chosen reply (the target, index 0), then the rejected one."""
    return [doc["chosen"], doc["rejected"]]


OWN_TASKS: dict[
    str, Callable[[dict[str, Any], PipelineConfig], tuple[list[dict[str, Any]], dict[str, Any]]]
] = {
    "pipeline_task": _task,
    "pipeline_pref": _pref,
}
"""The own tasks by name (pipeline.schema.stage_sections.OWN_LM_TASKS lists the same names; a test checks):
each gives its documents and its lm-eval config keys."""
