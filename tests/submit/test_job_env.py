"""The job entry point reads the job's facts once and hands them down (StageContext), and gives every job an
environment that keeps libraries off the network (NO_TELEMETRY)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from engine.context import DistEnv, StageContext
from pipeline.schema.compose import load_config
from pipeline.submit import launch

JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PIPELINE_FAULT",
    *launch.NO_TELEMETRY,
)


def test_job_env_keeps_the_users_choice() -> None:
    env = {"DO_NOT_TRACK": "false"}
    launch.export_job_env(env, DistEnv(1, 2, 1, "node0", 20001))
    assert env["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert env["DO_NOT_TRACK"] == "false"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "1",
        "2",
        "node0",
        "20001",
    )


def test_run_stage_hands_the_job_facts_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in JOB_VARS:  # restored after the test: run_stage sets them in this process
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIPELINE_FAULT", "raise@step:2")
    seen: dict[str, Any] = {}

    def fake_stage(stage: str, cfg: Any, ctx: StageContext) -> dict[str, Any]:
        seen.update(ctx=ctx, env={k: os.environ.get(k) for k in JOB_VARS})
        return {}

    monkeypatch.setattr(launch, "_call_stage", fake_stage)
    cfg = load_config(["experiment=tiny", "cluster=debug", f"run.root={tmp_path}"])
    launch.run_stage("data_prep", cfg.to_dict(), str(tmp_path / "run"), master_port=23456)
    ctx = seen["ctx"]
    assert ctx.dist == DistEnv(0, 1, 0, "127.0.0.1", 23456)
    assert (ctx.rank, ctx.world_size, ctx.faults) == (0, 1, "raise@step:2")
    assert seen["env"]["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert seen["env"]["DO_NOT_TRACK"] == "true"
    assert seen["env"]["MASTER_PORT"] == "23456"
