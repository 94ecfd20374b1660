"""The eval stage with ``eval.tasks``: lm-eval tasks (local task files in real tasks' format) on every evaluated
model through the engine backend; results.json, metrics.jsonl, the table and the sample logs carry them, and the
stage's own scores are what they are without tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stages.test_eval import run_eval_stage, small_config
from tests.support.lm_tasks import write_tasks
from tests.support.prep import run_prep


def test_eval_runs_lm_eval_tasks_for_each_model(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, task_examples=2, perplexity_batches=1)
    cfg.eval.models = ["pretrain", "sft"]
    tasks = write_tasks(tmp_path / "tasks")
    cfg.eval.tasks, cfg.eval.task_paths = ["local_mc", "local_gen"], [str(tasks)]
    cfg.eval.limit, cfg.eval.num_fewshot, cfg.eval.fewshot_seed, cfg.eval.log_samples = 3, 1, 7, True
    run = tmp_path / "run"
    run_prep(cfg, run / "stages" / "data_prep")
    proc = run_eval_stage(tmp_path, cfg, run, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    out = run / "stages" / "eval"
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["lm_eval"]["tasks"] == ["local_mc", "local_gen"]
    for model in ("pretrain", "sft"):
        r = results["models"][model]
        assert r["perplexity"] is not None and sorted(r["lm_eval"]) == ["local_gen", "local_mc"]
        mc, gen = r["lm_eval"]["local_mc"], r["lm_eval"]["local_gen"]
        assert sorted(mc["metrics"]) == ["acc", "acc_norm"] and mc["metrics"]["acc"]["stderr"] is not None
        assert 0.0 <= mc["metrics"]["acc"]["value"] <= 1.0
        assert "exact_match,strict-match" in gen["metrics"]
        assert (mc["version"], gen["version"]) == (1.0, 3.0)
        assert mc["samples"] == 3 and mc["num_fewshot"] == 1 and mc["fewshot_seed"] == 7
        assert len(mc["config_hash"]) == 16
        assert len((out / "lm_eval_samples" / model / "local_mc.jsonl").read_text().splitlines()) == 3
    # same weights in both: same task results
    assert results["models"]["pretrain"]["lm_eval"] == results["models"]["sft"]["lm_eval"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tasks_seen = [(x["model"], x["task"]) for x in lines if x["kind"] == "eval_task"]
    assert sorted(tasks_seen) == sorted(
        (m, t) for m in ("pretrain", "sft") for t in ("local_mc", "local_gen")
    )
    assert all("acc_stderr" in x for x in lines if x.get("task") == "local_mc")
    assert "local_mc" in proc.stdout and "acc_norm" in proc.stdout and "±" in proc.stdout  # the table
    ledger = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])  # what the ledger keeps
    assert (
        ledger["models"]["sft"]["lm_eval"]["local_mc"]
        == results["models"]["sft"]["lm_eval"]["local_mc"]["metrics"]
    )


def test_eval_applies_the_runs_chat_template_to_lm_eval_prompts(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, task_examples=2, perplexity_batches=1)
    cfg.eval.models = ["pretrain"]
    cfg.eval.tasks, cfg.eval.task_paths = ["local_mc"], [str(write_tasks(tmp_path / "tasks"))]
    cfg.eval.limit, cfg.eval.num_fewshot, cfg.eval.log_samples, cfg.eval.apply_chat_template = (
        2,
        1,
        True,
        True,
    )
    run = tmp_path / "run"
    run_prep(cfg, run / "stages" / "data_prep")
    run_eval_stage(tmp_path, cfg, run, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    out = run / "stages" / "eval"
    mc = json.loads((out / "results.json").read_text())["models"]["pretrain"]["lm_eval"]["local_mc"]
    assert mc["chat_template"] is True and mc["samples"] == 2
    first = json.loads((out / "lm_eval_samples" / "pretrain" / "local_mc.jsonl").read_text().splitlines()[0])
    context = first["arguments"][0][0]  # the first choice's request: (context, continuation)
    assert context.count("<|user|>") == 2 and context.endswith(
        "<|assistant|>"
    )  # a few-shot turn, the question


def test_the_runs_own_sets_are_lm_eval_tasks_with_the_stages_own_accuracies(tmp_path: Path) -> None:
    """eval.tasks=[pipeline_task, pipeline_pref]: the held-out task and preference pairs through lm-eval on the
    engine backend, the same examples, generation length, checker and pairs as the stage's own accuracies: the
    same accuracies."""
    cfg = small_config(tmp_path, task_examples=6, perplexity_batches=1)
    cfg.eval.models = ["pretrain"]
    cfg.eval.tasks = ["pipeline_task", "pipeline_pref"]
    run = tmp_path / "run"
    run_prep(cfg, run / "stages" / "data_prep")
    run_eval_stage(tmp_path, cfg, run, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    out = run / "stages" / "eval"
    results = json.loads((out / "results.json").read_text())
    r = results["models"]["pretrain"]
    own = r["lm_eval"]["pipeline_task"]
    assert own["samples"] == 6 and own["metrics"]["acc"]["value"] == r["task_accuracy"], (own, r)
    docs = [json.loads(d) for d in (out / "lm_eval_tasks" / "pipeline_task.jsonl").read_text().splitlines()]
    assert len(docs) == 6 and [d["answer"] for d in docs[:5]] == [s["answer"] for s in r["samples"]]
    pref, pairs = r["lm_eval"]["pipeline_pref"], results["data"]["pref_pairs"]
    assert pairs > 0 and pref["samples"] == pairs, (pref, results["data"])
    assert pref["metrics"]["acc"]["value"] == pytest.approx(r["pref_accuracy"], abs=1e-12), (pref, r)
    assert pref["metrics"]["acc"]["stderr"] is not None


def test_every_own_task_name_has_its_task() -> None:
    from pipeline.schema.stage_sections import OWN_LM_TASKS
    from stages.eval_own_tasks import OWN_TASKS

    assert tuple(OWN_TASKS) == OWN_LM_TASKS
