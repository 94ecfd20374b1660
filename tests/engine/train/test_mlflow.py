"""The MLflow sink on a tiny one-rank training run: metrics and params in a local SQLite store, a resume
continues the same MLflow run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_worker import launch

pytest.importorskip("mlflow")

SPEC: dict[str, Any] = {
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32},
    "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
    "samples": 8,
    "save_interval": 2,
    "sinks": ["mlflow"],
}
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def train_lines(metrics: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.timeout(300)
def test_mlflow_sink_logs_metrics_and_params_and_a_resume_continues_the_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "tiny-abc"
    stage = run_dir / "stages" / "pretrain"
    metrics = stage / "metrics.jsonl"
    spec = {
        **SPEC,
        "run_dir": str(run_dir),
        "stage_dir": str(stage),
        "metrics": str(metrics),
        "ckpt": str(stage / "checkpoints"),
    }
    launch(1, {**spec, "stage": {"iters": 2}}, tmp_path / "w1", extra_env=NO_TELEMETRY)
    rid = (stage / "mlflow" / "run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    run = client.get_run(rid)
    assert run.info.run_name == "pretrain" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tiny-abc"
    assert run.data.params["model.hidden_size"] == "64" and run.data.params["stage.iters"] == "2"
    hist = {m.step: m.value for m in client.get_metric_history(rid, "train/loss")}
    assert hist == pytest.approx(train_lines(metrics)) and sorted(hist) == [1, 2]
    assert {"summary.json", "metrics.jsonl"} <= {f.path for f in client.list_artifacts(rid)}

    r = launch(1, {**spec, "stage": {"iters": 4}}, tmp_path / "w2", extra_env=NO_TELEMETRY)
    assert r["resumed"]["iteration"] == 2
    assert (stage / "mlflow" / "run_id").read_text().strip() == rid
    assert [x.info.run_id for x in client.search_runs([run.info.experiment_id])] == [rid]
    hist = {m.step: m.value for m in client.get_metric_history(rid, "train/loss")}
    assert sorted(hist) == [1, 2, 3, 4] and hist == pytest.approx(train_lines(metrics))
    assert client.get_run(rid).data.params["stage.iters"] == "2"  # params are immutable: the first run's
