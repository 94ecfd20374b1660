"""Observability: callbacks and sinks, alarms, MFU/memory fields, OOM report, status alarms, report CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.callbacks.alarms import GRAD_NORM, LOSS_SPIKE, STALL, THROUGHPUT, Alarms
from engine.train.callback import Callback, Callbacks, StageInfo, view
from pipeline.records.ledger import Ledger
from pipeline.schema.build import from_dict
from pipeline.schema.stage_sections import MonitorConfig
from tests.support.engine_worker import launch
from tests.support.env import REPO as ROOT
from tests.support.metrics import tb_scalars
from tests.support.timing import scaled

# ---------------------------------------------------------------------------- the seam in the real loop


@pytest.mark.timeout(600)
def test_tensorboard_mirrors_metrics_and_a_raising_sink_does_not_stop_training(tmp_path: Path) -> None:
    metrics, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    spec = {
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
        "stage": {"iters": 3},
        "samples": 8,
        "metrics": str(metrics),
        "tensorboard": str(tb),
        "raising_sink": True,
    }
    r = launch(1, spec, tmp_path)
    assert r["summary"]["steps"] == 3
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    valid = [x for x in lines if x["kind"] == "valid"]
    for key in ("time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_checkpoint_s", "mem_rss_gb"):
        assert key in train[-1], key
    got = tb_scalars(tb)
    assert [x["step"] for x in train] == sorted(got["train/loss"])
    for rec in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mem_rss_gb"):
            assert got[f"train/{key}"][rec["step"]] == pytest.approx(rec[key], rel=1e-6, abs=1e-12), key
    assert got["valid/loss"][valid[-1]["step"]] == pytest.approx(valid[-1]["loss"], rel=1e-6)


def test_failing_callback_is_disabled_and_the_others_still_run() -> None:
    seen: list[int] = []

    class Boom(Callback):
        def on_step_end(self, view: Any) -> None:
            raise OSError("disk full")

    class Record(Callback):
        def on_step_end(self, view: Any) -> None:
            seen.append(view.step)
            with pytest.raises(TypeError):
                view.metrics["loss"] = 0.0  # type: ignore[index]  # read-only view

    cbs = Callbacks([Boom(), Record()], StageInfo("pretrain", Path(".")))
    for s in (1, 2):
        cbs.emit("on_step_end", s, {"loss": 1.0}, logged=True)
    assert seen == [1, 2] and list(cbs.disabled) == ["Boom"] and "disk full" in cbs.disabled["Boom"]
    cbs.close()


# ---------------------------------------------------------------------------- alarms


def _alarms(**cfg: Any) -> tuple[Alarms, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    return Alarms(MonitorConfig(**cfg), out.append), out


def _feed(a: Alarms, rows: list[tuple[float, float, float]]) -> None:
    for loss, gn, tps in rows:
        metrics = {"kind": "train", "loss": loss, "grad_norm": gn, "tokens_per_s": tps}
        a.on_step_end(view(StageInfo("pretrain", Path(".")), a.step + 1, metrics, logged=True))


def test_alarms_fire_on_loss_spike_grad_norm_and_throughput_drop() -> None:
    a, out = _alarms(alarm_stall_s=0)
    steady = [(4.0 - 0.1 * i, 1.0, 1000.0) for i in range(5)]
    _feed(a, steady)
    assert out == []
    _feed(a, [(20.0, 1.0, 1000.0)])  # loss spike
    _feed(a, [(3.0, 3e5, 1000.0)])  # gradient norm explosion
    _feed(a, [(3.0, 1.0, 100.0)])  # throughput collapse
    _feed(a, [(3.0, float("nan"), 1000.0)])  # a non-finite norm also fires
    assert [x["alarm"] for x in out] == [LOSS_SPIKE, GRAD_NORM, THROUGHPUT, GRAD_NORM]
    assert all(x["kind"] == "alarm" and x["message"] for x in out)


def test_stall_alarm_fires_once_per_stalled_step() -> None:
    now = [0.0]
    out: list[dict[str, Any]] = []
    a = Alarms(MonitorConfig(alarm_stall_s=10), out.append, clock=lambda: now[0])
    a.last_progress, a.step = 0.0, 7
    now[0] = 5.0
    a.check_stall()
    assert out == []
    now[0] = 11.0
    a.check_stall()
    a.check_stall()
    assert [(x["alarm"], x["step"]) for x in out] == [(STALL, 7)]


def test_stall_alarm_thread_fires_in_real_time() -> None:
    import time

    out: list[dict[str, Any]] = []
    a = Alarms(MonitorConfig(alarm_stall_s=0.2), out.append)
    a.on_train_start(view(StageInfo("pretrain", Path(".")), 3))
    deadline = time.monotonic() + scaled(30)
    while not out and time.monotonic() < deadline:
        time.sleep(0.05)
    a.close()
    assert out and out[0]["alarm"] == STALL and out[0]["step"] == 3


def test_monitor_config_is_validated_with_the_key_named() -> None:
    with pytest.raises(ValueError, match="alarm_loss_spike"):
        from_dict({"pretrain": {"monitor": {"alarm_loss_spike": 0.5}}})
    with pytest.raises(ValueError, match=r"pretrain.monitor.alarm_spike=2: unknown key"):
        from_dict({"pretrain": {"monitor": {"alarm_spike": 2}}})


def test_sinks_are_a_registry_checked_at_config_time() -> None:
    from engine.callbacks.setup import SINKS
    from pipeline.schema.stage_sections import SINK_NAMES

    assert tuple(SINKS) == SINK_NAMES
    assert from_dict({}).pretrain.monitor.sinks == ["tensorboard"]  # today's default
    with pytest.raises(
        ValueError, match=r"pretrain.monitor.sinks='mlfow': must be one of .*did you mean 'mlflow'"
    ):
        from_dict({"pretrain": {"monitor": {"sinks": ["tensorboard", "mlfow"]}}})
    with pytest.raises(ValueError, match=r"sft.monitor.sinks=.*each sink at most once"):
        from_dict({"sft": {"monitor": {"sinks": ["wandb", "wandb"]}}})


def test_unknown_sink_fails_at_compose_before_any_job(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.plan",
            "experiment=tiny",
            "pretrain.monitor.sinks=[tensorboard,neptune]",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=scaled(120),
    )
    assert r.returncode != 0 and "pretrain.monitor.sinks='neptune'" in r.stderr + r.stdout, r.stderr


def test_stage_callbacks_build_the_named_sinks_then_alarms(tmp_path: Path) -> None:
    from engine.callbacks.mlflow import MLflow
    from engine.callbacks.setup import stage_callbacks
    from engine.callbacks.tensorboard import TensorBoard
    from engine.context import MetricsWriter, StageContext

    cfg = from_dict({"pretrain": {"monitor": {"sinks": ["mlflow", "tensorboard"]}}})
    ctx = StageContext(tmp_path, "pretrain", tmp_path / "stages" / "pretrain")
    metrics = MetricsWriter(ctx.metrics_path, enabled=False)
    cbs = stage_callbacks(cfg, ctx, cfg.pretrain, metrics, 0, 1)
    assert [type(c) for c in cbs.callbacks] == [MLflow, TensorBoard, Alarms]
    assert cbs.callbacks[0].uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"  # type: ignore[attr-defined]
    assert not stage_callbacks(cfg, ctx, cfg.pretrain, metrics, 1, 2)  # rank 0 only


def _fake_run(tmp_path: Path) -> Path:
    run = tmp_path / "tiny-abc"
    ledger = Ledger(run)
    ledger.update("pretrain", status="completed", attempts=1)
    m = run / "stages" / "pretrain" / "metrics.jsonl"
    m.parent.mkdir(parents=True)
    rows = [
        {
            "time": 1.0,
            "kind": "train",
            "step": 1,
            "iters": 2,
            "loss": 5.0,
            "tokens_per_s": 100.0,
            "mfu": 0.05,
        },
        {
            "time": 2.0,
            "kind": "alarm",
            "alarm": "loss_spike",
            "step": 2,
            "message": "loss 50 > 3 x running mean 5",
        },
    ]
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_alarms_appear_in_status_and_are_forwarded_to_events_once(tmp_path: Path) -> None:
    from pipeline.records.alarm_log import forward_alarms

    run = _fake_run(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.status", str(run)], capture_output=True, text=True, cwd=ROOT
    )
    assert "ALARM loss_spike at step 2: loss 50 > 3 x running mean 5" in r.stdout, r.stdout + r.stderr
    ledger = Ledger(run)
    assert forward_alarms(ledger, "pretrain") == 1 and forward_alarms(ledger, "pretrain") == 0
    (ev,) = [e for e in ledger.events() if e["event"] == "alarm"]
    assert ev["alarm"] == "loss_spike" and ev["step"] == 2


def test_progress_line_shows_mfu_and_memory() -> None:
    from pipeline.records.progress import format_record

    line = format_record(
        "pretrain", {"kind": "train", "step": 3, "iters": 9, "loss": 2.0, "mfu": 0.123, "mem_rss_gb": 0.45}
    )
    assert "MFU 12.3%" in line and "mem 0.45 GiB" in line  # type: ignore[operator]


def test_meter_tflops_and_mfu() -> None:
    from engine.train.meter import StepMeter

    m = StepMeter(flops_per_step=2e12, peak_tflops=10.0, world_size=2)
    with m.time("data"):
        pass
    f = m.fields(steps=4, compute_s=2.0)
    assert f["tflops"] == pytest.approx(4.0) and f["mfu"] == pytest.approx(0.2)
    assert set(f) >= {"time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_checkpoint_s", "mem_rss_gb"}


def test_oom_report_names_the_planner_estimate_and_fix(tmp_path: Path) -> None:
    from engine.context import MetricsWriter, StageContext
    from engine.runtime.oom import oom_report
    from pipeline.schema.compose import load_config

    cfg = load_config(["model=llama3.1-8b", "cluster=gpu_ib"])
    ctx = StageContext(run_dir=tmp_path, stage="pretrain", out_dir=tmp_path)
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")

    class FakeOOM(RuntimeError):
        pass

    with pytest.raises(FakeOOM):
        with oom_report(
            cfg, ctx, metrics, rank=0, summary=lambda: "|  Allocated memory  | 79 GiB |", oom_type=FakeOOM
        ):
            raise FakeOOM("CUDA out of memory. Tried to allocate 2.00 GiB")
    text = (tmp_path / "oom_rank0.txt").read_text()
    assert "Tried to allocate 2.00 GiB" in text and "Allocated memory" in text
    assert "planner estimate:" in text and "GiB per GPU" in text
    assert "cheapest change of layout that fits: pretrain.parallel." in text, text
    alarm = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert alarm["alarm"] == "oom" and "oom_rank0.txt" in alarm["message"]


def test_report_cli_rejects_a_path_that_is_no_run(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.report", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 2 and r.stderr.startswith("config error: path=")


def test_report_of_a_run_and_of_a_sweep(tmp_path: Path) -> None:
    from pipeline.reporting.html import write_report

    run = _fake_run(tmp_path)
    page = write_report(run).read_text()
    assert "loss_spike" in page and 'id="curves-pretrain"' in page and "http" not in page.split("<body")[0]
    sweep = write_report(tmp_path).read_text()
    assert "tiny-abc" in sweep and 'class="trials"' in sweep


def test_wandb_run_id_is_kept_in_the_stage_dir_for_resume(tmp_path: Path) -> None:
    from engine.callbacks.wandb import WandB, mode

    first = WandB(tmp_path, "p", "run-abc", "pretrain", {}).run_id()
    again = WandB(tmp_path, "p", "run-abc", "pretrain", {}).run_id()  # a resumed stage: a new process
    assert first == again == (tmp_path / "wandb" / "run_id").read_text().strip()
    assert mode() in ("offline", "online", "disabled", "dryrun")


def test_timeline_shows_each_attempt_and_how_it_ended(tmp_path: Path) -> None:
    from pipeline.reporting.html import attempts, run_report

    run = _fake_run(tmp_path)
    ledger = Ledger(run)
    for e in ("started", "requeued", "started", "started", "completed"):
        ledger.event(e, "pretrain", error="node died" if e == "requeued" else None)
    m = run / "stages" / "pretrain" / "metrics.jsonl"
    with open(m, "a") as f:
        f.write(
            json.dumps({"time": 3.0, "kind": "resume", "from_step": 4, "reached_step": 6, "steps_lost": 2})
            + "\n"
        )
    got = [a["how"] for a in attempts(ledger.events(), "pretrain", now=1e12)]
    assert got == ["requeued", "lost", "completed"]
    page = run_report(run)
    assert page.count('class="attempt"') == 3 and "node died" in page
