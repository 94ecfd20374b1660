"""Bad steps (NaN/Inf loss or grad norm, spikes) under each ``nan_policy``, and async checkpoint saves.

The fast tests cover the guard and the config keys. The slow ones run ``python -m pipeline`` (local
executor) on the tiny experiment with ``PIPELINE_FAULT=nan@step:4`` (engine/runtime/fault_injection.py: step 4's loss,
and so its gradients, become NaN) and compare final checkpoints bit for bit:

- skip: step 4's update is not applied (the batch is consumed, the LR schedule and Adam's step count do
  not advance). Exactly comparable run: the rollback run below, which restores step 2's checkpoint,
  replays step 3 and consumes batch 4 *without computing it*; its final tensors equal the skip run's.
- stop: the stage fails with an error naming step 4 and the policy.
- async_save: periodic saves in the background give the same checkpoints as synchronous ones, and a kill
  while one is in flight resumes to the same final state.
- save_interval=auto: saves at the steps of its recorded choices (Young/Daly, engine/checkpoint/interval.py)
  and ends with the same weights as a fixed interval.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from engine.train.bad_steps import SPIKE_MIN_HISTORY, BadStepGuard, reason_code, reason_from_code
from pipeline.records.ledger import Ledger
from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.errors import ConfigError
from pipeline.schema.identity import stage_hashes
from tests.support import cli
from tests.support.cli import metrics, ok, run_dir, seeded

BASE = ["experiment=tiny", "run.stages=[data_prep,pretrain]", "pretrain.save_interval=2"]


# ---------------------------------------------------------------------------- fast: guard and config


def test_guard_reasons_and_spikes() -> None:
    guard = BadStepGuard(spike_factor=3.0)
    assert guard.check(False, 1.0) == "nonfinite_loss"
    assert guard.check(True, math.nan) == "nonfinite_grad"
    assert guard.check(True, math.inf) == "nonfinite_grad"
    assert guard.check(True, 100.0) is None, "no spike verdict before SPIKE_MIN_HISTORY good steps"
    for step in range(1, SPIKE_MIN_HISTORY + 1):
        guard.good(step, 1.0 + step / 100)
    assert guard.check(True, 2.9) is None
    assert guard.check(True, 3.5) == "grad_spike"
    assert BadStepGuard(spike_factor=0.0, max_bad_steps=2).is_spike(1e9) is False
    for reason in (None, "grad_spike", "nonfinite_grad", "nonfinite_loss"):
        assert reason_from_code(reason_code(reason)) == reason
    assert reason_code("nonfinite_loss") > reason_code("grad_spike"), "the max over ranks is the worst"


def test_guard_counts_bad_steps_in_a_row_across_a_rollback() -> None:
    guard = BadStepGuard()
    assert guard.bad(5) == 1
    guard.good(3, 1.0)  # replayed after rolling back to step 2: not progress past the bad step
    guard.good(4, 1.0)
    assert guard.bad(6) == 2
    guard.good(7, 1.0)
    assert guard.in_a_row == 0
    restored = BadStepGuard()
    restored.load_state(json.loads(json.dumps(guard.state())))
    assert restored.state() == guard.state()


@pytest.mark.parametrize(
    ("key", "value"),
    [("nan_policy", "ignore"), ("grad_spike_factor", 0.5), ("grad_spike_factor", -1.0), ("max_bad_steps", 0)],
)
def test_config_rejects_bad_values_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"^{key}="):
        TrainStage(**{key: value})  # type: ignore[arg-type]


def test_policy_and_async_keys_do_not_change_the_stage_hash() -> None:
    base = PipelineConfig()
    changed = dataclasses.replace(
        base,
        pretrain=dataclasses.replace(base.pretrain, nan_policy="rollback", max_bad_steps=3, async_save=True),
    )
    assert stage_hashes(base) == stage_hashes(changed)


# ---------------------------------------------------------------------------- slow: the real command line

run = partial(cli.run, base=BASE)


def ckpts(root: Path) -> Path:
    return run_dir(root) / "stages" / "pretrain" / "checkpoints"


def tensors(root: Path, iteration: int = 6) -> dict[str, torch.Tensor]:
    from engine.checkpoint.layout import iter_dir_name
    from engine.checkpoint.load import load_tensors

    return load_tensors(ckpts(root) / iter_dir_name(iteration))


def saved_state(root: Path, iteration: int = 6) -> dict:
    from engine.checkpoint.layout import iter_dir_name

    common = torch.load(ckpts(root) / iter_dir_name(iteration) / "common.pt", weights_only=False)
    return common["checkpoint"]


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"tensors differ: {diff[:5]}"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    ok(run(root, "run.stages=[data_prep]"))
    return root


@pytest.fixture(scope="module")
def skip_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = seeded(data_root, tmp_path_factory.mktemp("skip"))
    ok(run(root, fault="nan@step:4"))
    return root


@pytest.fixture(scope="module")
def sync_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = seeded(data_root, tmp_path_factory.mktemp("sync"))
    ok(run(root))
    return root


@pytest.mark.slow
def test_skip_policy_drops_the_update_and_continues(skip_run: Path, sync_run: Path) -> None:
    events = metrics(skip_run, "bad_step")
    assert [(e["step"], e["reason"], e["action"]) for e in events] == [(4, "nonfinite_loss", "skip")]
    train = {m["step"]: m for m in metrics(skip_run, "train")}
    assert math.isnan(train[4]["loss"]) and math.isfinite(train[6]["loss"])
    final = tensors(skip_run)
    assert all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())
    assert saved_state(skip_run)["scheduler"]["num_steps"] == 5, "the skipped step did not advance the LR"
    assert not torch.equal(
        final["embedding.word_embeddings.weight"], tensors(sync_run)["embedding.word_embeddings.weight"]
    )


@pytest.mark.slow
def test_rollback_reloads_skips_the_batch_and_equals_the_skip_run(
    data_root: Path, skip_run: Path, tmp_path: Path
) -> None:
    root = seeded(data_root, tmp_path)
    ok(run(root, "pretrain.nan_policy=rollback", fault="nan@step:4"))
    events = metrics(root, "bad_step")
    assert [(e["step"], e["action"], e["to_step"]) for e in events] == [(4, "rollback", 2)]
    assert math.isfinite(metrics(root, "train")[-1]["loss"])
    state = saved_state(root)["state"]
    assert state["skipped_steps"] == [4], "kept in checkpoints: a resume keeps skipping the batch"
    assert_identical(tensors(root), tensors(skip_run))


@pytest.mark.slow
def test_stop_policy_and_max_bad_steps_fail_naming_the_step(data_root: Path, tmp_path: Path) -> None:
    root = seeded(data_root, tmp_path / "stop")
    r = run(root, "pretrain.nan_policy=stop", fault="nan@step:4")
    assert r.returncode != 0
    assert "step 4: nonfinite_loss" in r.stderr and "nan_policy=stop" in r.stderr, r.stderr[-2000:]
    root = seeded(data_root, tmp_path / "max")
    r = run(root, "pretrain.max_bad_steps=2", fault="nan@step:3,nan@step:4")
    assert r.returncode != 0
    assert "step 4: nonfinite_loss" in r.stderr and "2 bad step(s) in a row" in r.stderr, r.stderr[-2000:]
    assert [e["action"] for e in metrics(root, "bad_step")] == ["skip", "stop"]


@pytest.mark.slow
def test_async_saves_equal_sync_saves(data_root: Path, sync_run: Path, tmp_path: Path) -> None:
    root = seeded(data_root, tmp_path)
    ok(run(root, "pretrain.async_save=true"))
    saves = [(m["step"], m["async"]) for m in metrics(root, "checkpoint")]
    assert saves == [(2, True), (4, True), (6, False)], "periodic saves async, the final one sync"
    for iteration in (4, 6):
        assert_identical(tensors(root, iteration), tensors(sync_run, iteration))


@pytest.mark.slow
def test_kill_with_an_async_save_in_flight_resumes_exactly(
    data_root: Path, sync_run: Path, tmp_path: Path
) -> None:
    root = seeded(data_root, tmp_path)
    first = run(root, "pretrain.async_save=true", fault="kill@step:5")
    assert first.returncode != 0
    ok(run(root, "pretrain.async_save=true", fault="kill@step:5"))
    (resume,) = metrics(root, "resume")
    assert resume["from_step"] in (2, 4)
    assert_identical(tensors(root), tensors(sync_run))


@pytest.mark.slow
def test_auto_save_interval_saves_when_it_chose_and_changes_nothing(
    data_root: Path, sync_run: Path, tmp_path: Path
) -> None:
    """save_interval=auto with a node failing every 7.2 s: the planner's estimate is replaced by measured
    choices, the saves fall at the steps those recorded choices say (how many depends on this machine's step
    and save times), and the final weights equal the fixed-interval run's."""
    root = seeded(data_root, tmp_path)
    ok(run(root, "pretrain.save_interval=auto", "cluster.node_mtbf_hours=0.002"))
    chosen = metrics(root, "save_interval")
    assert chosen[0]["source"] == "planner estimate" and chosen[0]["step"] == 1, chosen
    assert all(r["mtbf_h"] == 0.002 and r["nodes"] == 1 for r in chosen)
    measured = {r["step"]: r["interval"] for r in chosen[1:]}
    assert len(chosen) > 1 and all(r["source"] == "measured" for r in chosen[1:]), chosen
    current, last, expected = chosen[0]["interval"], 0, []
    for s in range(1, 7):
        if s - last >= current or s == 6:
            expected.append(s)
            last, current = s, measured.get(s, current)
    saves = [m["step"] for m in metrics(root, "checkpoint")]
    assert saves == expected, (saves, chosen)
    assert_identical(tensors(root), tensors(sync_run))


@pytest.mark.slow
def test_in_training_tasks_are_recorded_and_change_no_weight_across_a_kill(
    data_root: Path, sync_run: Path, tmp_path: Path
) -> None:
    """pretrain.eval_tasks: lm-eval tasks with each validation (every 2 steps and at the end), in metrics.jsonl,
    TensorBoard and the report's curves; killed at step 5 and resumed, the final weights still equal the run
    without them (the evaluator draws nothing from the training RNG or data). The eval stage after it runs the
    same tasks on the final model: its results are events of the run too."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.reporting.html import task_charts
    from tests.support.lm_tasks import write_tasks

    root = tmp_path / "root"  # the tasks make it another run: only the shared data prepared before is seeded
    shutil.copytree(data_root / ".data", root / ".data", symlinks=True)
    tasks = write_tasks(tmp_path / "tasks")
    args = (
        "pretrain.eval_tasks=[local_mc,local_gen]",
        f"eval.task_paths=[{tasks}]",
        "pretrain.eval_interval=2",
        "pretrain.eval_task_limit=2",
        "eval.max_gen_toks=4",
        "run.stages=[data_prep,pretrain,eval]",
        "eval.models=[pretrain]",
        "eval.tasks=[local_mc]",
        "eval.limit=2",
        "eval.num_task_examples=2",
    )
    assert run(root, *args, fault="kill@step:5").returncode != 0
    ok(run(root, *args, fault="kill@step:5"))
    lines = metrics(root, "eval_task")
    by_step = {(r["step"], r["task"]) for r in lines}
    assert {(s, t) for s in (2, 4, 6) for t in ("local_mc", "local_gen")} <= by_step, by_step
    mc = next(r for r in lines if r["task"] == "local_mc")
    assert 0.0 <= mc["acc"] <= 1.0 and "acc_stderr" in mc and mc["eval_task_s"] > 0
    assert_identical(tensors(root), tensors(sync_run))
    tb = EventAccumulator(str(run_dir(root) / "stages" / "pretrain" / "tensorboard"))
    tb.Reload()
    assert "tasks/local_mc/acc" in tb.Tags()["scalars"], tb.Tags()["scalars"]
    charts = task_charts("pretrain", lines)
    assert len(charts) == 2 and "pretrain: local_mc" in charts[0]
    events = Ledger(run_dir(root)).events()
    (task_event,) = [e for e in events if e["event"] == "eval_task"]
    assert (
        task_event["stage"] == "eval"
        and task_event["model"] == "pretrain"
        and task_event["task"] == "local_mc"
    )
    assert set(task_event["metrics"]) == {"acc", "acc_norm"} and task_event["samples"] == 2
    done = [e["event"] for e in events if e.get("stage") == "eval"]
    assert done.index("eval_task") < done.index("completed")
    outputs = Ledger(run_dir(root)).read("eval").outputs  # type: ignore[union-attr]
    assert (
        "events" not in outputs
        and outputs["models"]["pretrain"]["lm_eval"]["local_mc"] == task_event["metrics"]
    )
