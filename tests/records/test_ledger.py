"""Ledger records, event log, skip/resubmit decisions, dry-run scripts: no jobs run here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.records.ledger import COMPLETED, FAILED, RUNNING, Ledger, StageRecord
from pipeline.schema.compose import load_config
from pipeline.schema.identity import stage_hashes
from pipeline.submit.launch import sbatch_script
from pipeline.submit.orchestrate import RunError, decide, run_dir_for
from tests.support.timing import scaled

REFERENCE = Path(__file__).parent / "data" / "dryrun_gpu_ib_pretrain.sbatch"


def test_atomic_record_roundtrip(tmp_path: Path) -> None:
    led = Ledger(tmp_path)
    led.write(StageRecord(stage="pretrain", status=RUNNING, job_ids=["12"]))
    led.update("pretrain", status=COMPLETED, outputs={"checkpoint": "x"})
    rec = led.read("pretrain")
    assert rec and rec.status == COMPLETED and rec.job_ids == ["12"] and rec.outputs == {"checkpoint": "x"}
    assert not list((tmp_path / "ledger").glob("*.tmp"))
    with pytest.raises(KeyError):
        led.update("pretrain", nonsense=1)


def test_event_log_tolerates_a_cut_line(tmp_path: Path) -> None:
    led = Ledger(tmp_path)
    led.event("submitted", "pretrain", job_id="1")
    with open(led.events_path, "a") as f:
        f.write('{"event": "cut')
    led.event("completed", "pretrain")
    assert [e["event"] for e in led.events()] == ["submitted", "completed"]


def _complete(led: Ledger, hashes: dict[str, str], *stages: str) -> None:
    for s in stages:
        led.write(StageRecord(stage=s, status=COMPLETED, hash=hashes[s]))


def test_decide_skips_completed_and_resubmits_failed_with_dependents(tmp_path: Path) -> None:
    cfg = load_config([f"run.root={tmp_path}"])
    hashes = stage_hashes(cfg)
    led = Ledger(run_dir_for(cfg))
    _complete(led, hashes, "data_prep", "pretrain")
    led.write(StageRecord(stage="sft", status=FAILED, hash=hashes["sft"]))
    _complete(led, hashes, "rlhf")  # stale: depends on the failed sft, so it reruns
    d = decide(cfg, led)
    assert d.skip == ["data_prep", "pretrain"]
    assert d.submit == ["sft", "rlhf", "eval"]


def test_decide_all_done_submits_nothing(tmp_path: Path) -> None:
    cfg = load_config([f"run.root={tmp_path}"])
    led = Ledger(run_dir_for(cfg))
    _complete(led, stage_hashes(cfg), "data_prep", "pretrain", "sft", "rlhf", "eval")
    d = decide(cfg, led)
    assert d.submit == [] and len(d.skip) == 5


def test_decide_leaves_live_jobs_alone(tmp_path: Path) -> None:
    cfg = load_config([f"run.root={tmp_path}", "run.stages=[data_prep,pretrain]"])
    hashes = stage_hashes(cfg)
    led = Ledger(run_dir_for(cfg))
    _complete(led, hashes, "data_prep")
    led.write(
        StageRecord(
            stage="pretrain", status=RUNNING, hash=hashes["pretrain"], executor="slurm", job_ids=["7"]
        )
    )
    assert decide(cfg, led, alive=lambda rec: True).active == ["pretrain"]
    assert decide(cfg, led, alive=lambda rec: False).submit == ["pretrain"]


def test_subset_needs_completed_upstream(tmp_path: Path) -> None:
    cfg = load_config([f"run.root={tmp_path}", "run.stages=[sft]"])
    with pytest.raises(RunError, match=r"stage 'sft' needs 'data_prep'.*run.stages="):
        decide(cfg, Ledger(run_dir_for(cfg)))


def test_changed_stage_config_reruns_that_stage(tmp_path: Path) -> None:
    cfg = load_config([f"run.root={tmp_path}"])
    led = Ledger(run_dir_for(cfg))
    _complete(led, stage_hashes(cfg), "data_prep", "pretrain", "sft", "rlhf", "eval")
    cfg2 = load_config([f"run.root={tmp_path}", "eval.max_new_tokens=5"])
    assert decide(cfg2, Ledger(run_dir_for(cfg))).submit == ["eval"]


def test_dry_run_script_matches_reference() -> None:
    cfg = load_config(
        [
            "cluster=gpu_ib",
            "run.root=/shared/runs",
            "pretrain.parallel.tp=4",
            "pretrain.parallel.nodes=2",
            "pretrain.parallel.global_batch_size=64",
        ]
    )
    run_dir = run_dir_for(cfg)
    text = sbatch_script(cfg, "pretrain", run_dir, Path("/shared/runs/code"))
    text = text.replace(str(run_dir), "<run_dir>")
    if os.environ.get("UPDATE_REFERENCE") == "1":  # regenerate after an intended change, then review the diff
        REFERENCE.write_text(text)
    assert text == REFERENCE.read_text()
    assert (
        "#SBATCH --nodes=2" in text
        and "#SBATCH --ntasks-per-node=8" in text
        and "#SBATCH --gpus-per-node=8" in text
    )


_WRITER = """
import sys, time
from pathlib import Path
from pipeline.records.ledger import Ledger
led, me, n = Ledger(Path(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
go = Path(sys.argv[1]) / "go"
while not go.exists():
    time.sleep(0.005)
for i in range(n):
    with led.lock():  # a command's check-then-update, e.g. cancel reading a record then marking it
        rec = led.read("pretrain")
        rec.attempts += 1
        rec.outputs = {**rec.outputs, f"w{me}": i + 1}
        led.write(rec)
    led.update("pretrain", **{("host", "log", "error")[me]: f"{me}:{i + 1}"})  # one RMW of the record
    led.event("tick", "pretrain", writer=me, i=i)
"""


def test_concurrent_commands_lose_no_update(tmp_path: Path) -> None:
    """Three processes hammer one run directory's ledger at once: every update and every event survives."""
    import subprocess
    import sys

    led, writers, n = Ledger(tmp_path), 3, 60
    led.write(StageRecord(stage="pretrain"))
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w), str(n)])
        for w in range(writers)
    ]
    try:
        (tmp_path / "go").touch()
        for p in procs:
            assert p.wait(timeout=scaled(300)) == 0
    finally:
        for p in procs:
            p.kill()
    rec = led.read("pretrain")
    assert rec is not None
    assert rec.attempts == writers * n
    assert rec.outputs == {f"w{w}": n for w in range(writers)}
    assert (rec.host, rec.log, rec.error) == (f"0:{n}", f"1:{n}", f"2:{n}")
    ticks = [e for e in led.events() if e["event"] == "tick"]
    assert len(ticks) == writers * n
    assert (tmp_path / "events.jsonl").read_text().count("\n") == writers * n
