"""A trial's state from its command and its ledger (pipeline.search.trials.state), without a cluster: a SLURM
trial whose command was cut off mid-submission is started again (a bounded number of times); its submitted
stages' jobs alone keep it running; a failed stage fails it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.records.ledger import Ledger
from pipeline.search import trials
from pipeline.slurm.queries import alive_jobs


def trial(tmp_path: Path, executor: str = "slurm", commands: int = 1) -> trials.TrialFile:
    # pid None: its command has ended (as on another node, or after the controller's job was requeued)
    run = tmp_path / "run"
    return trials.TrialFile(0, [], str(run), ["data_prep", "pretrain"], executor, commands=commands)


def test_a_trial_cut_off_mid_submission_is_started_again_a_bounded_number_of_times(tmp_path: Path) -> None:
    t = trial(tmp_path)
    Ledger(t.path_dir).update("data_prep", status="submitted", job_ids=["11"])
    assert trials.state(t, {"11"})[0] == trials.CUT_OFF  # pretrain never submitted
    assert trials.state(trial(tmp_path, commands=0), set())[0] == trials.CUT_OFF  # nothing submitted
    spent = trial(tmp_path, commands=trials.MAX_COMMANDS)
    assert trials.state(spent, {"11"})[0] == trials.RUNNING  # its jobs still run
    assert trials.state(spent, set())[0] == trials.FAILED


def test_submitted_jobs_keep_a_slurm_trial_running_and_a_failed_stage_fails_it(tmp_path: Path) -> None:
    t = trial(tmp_path)
    ledger = Ledger(t.path_dir)
    ledger.update("data_prep", status="completed")
    ledger.update("pretrain", status="running", job_ids=["12"])
    assert trials.state(t, {"12"})[0] == trials.RUNNING
    ledger.update("pretrain", status="failed", error="out of memory")
    state, why = trials.state(t, {"12"})
    assert state == trials.FAILED and "pretrain: failed (out of memory)" in why
    ledger.update("pretrain", status="completed")
    assert trials.state(t, set())[0] == trials.COMPLETE


def test_a_local_trial_whose_command_ended_early_failed(tmp_path: Path) -> None:
    t = trial(tmp_path, executor="local")
    Ledger(t.path_dir).update("data_prep", status="completed")
    assert trials.state(t, set())[0] == trials.FAILED  # local commands run their stages: never started again


def test_a_slurm_query_that_failed_is_unknown_not_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """squeue killed or timed out (the controller's job being cancelled, slurmctld busy): alive_jobs says None
    and the trial runs on until a poll that SLURM answers; its ledger still fails it on its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd in ("squeue", "sacct"):
        (bin_dir / cmd).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out' >&2\nexit 1\n")
        (bin_dir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert alive_jobs(["12"]) is None
    t = trial(tmp_path, commands=trials.MAX_COMMANDS)
    ledger = Ledger(t.path_dir)
    ledger.update("data_prep", status="completed")
    ledger.update("pretrain", status="running", job_ids=["12"])
    assert trials.state(t, None)[0] == trials.RUNNING
    assert trials.state(t, set())[0] == trials.FAILED
    ledger.update("pretrain", status="failed", error="out of memory")
    assert trials.state(t, None)[0] == trials.FAILED
