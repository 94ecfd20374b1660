"""Every failed attempt gets a cause: the labelled failure logs of the project's drills, real exceptions made
here (a CPU allocation too large, a write to a full device, a bad config value), the ledger and status."""

from __future__ import annotations

import errno
import signal
from pathlib import Path

import pytest

from pipeline.records import causes
from pipeline.records.causes import CAUSES, Evidence, classify, from_exception
from pipeline.records.ledger import FAILED, Ledger
from tests.support import failure_logs

CASES = failure_logs.cases()


def test_the_labelled_set_covers_every_cause() -> None:
    assert set(CAUSES) <= {c["label"] for c in CASES.values()} | {"out_of_memory", "storage", "configuration"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_labelled_failure_log_is_classified_as_labelled(name: str) -> None:
    case = CASES[name]
    got = classify(failure_logs.evidence(case))
    assert got.name == case["label"], f"{name}: {got} ({case['source']})"


def test_logs_alone_give_the_same_cause_as_logs_with_rank0s_error() -> None:
    """The submitter sees only the logs of a local job that died; a drill's logs carry the cause on their own."""
    for name in ("drill_hang", "drill_nan_stop", "drill_raise", "drill_dp2_rank1_killed"):
        case = CASES[name]
        assert classify(Evidence(log=case["log"])).name == case["label"], name


def _raised(fn) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:
        return e
    raise AssertionError("did not raise")


def test_real_exceptions_made_here() -> None:
    import torch

    from pipeline.schema.build import from_dict

    def full_disk() -> None:
        with open("/dev/full", "w") as f:  # noqa: PTH123
            f.write("x")
            f.flush()

    oom = _raised(lambda: torch.empty(2**62, dtype=torch.uint8))
    assert classify(from_exception(oom)).name == "out_of_memory", oom
    disk = _raised(full_disk)
    assert isinstance(disk, OSError) and disk.errno == errno.ENOSPC
    assert classify(from_exception(disk)).name == "storage"
    wrapped = _raised(lambda: _reraise(disk))  # a library wraps the OSError: the chain still counts
    assert classify(from_exception(wrapped)).name == "storage"
    bad = _raised(lambda: from_dict({"pretrain": {"nan_policy": "sometimes"}}))
    assert classify(from_exception(bad)).name == "configuration", bad
    assert classify(from_exception(_raised(lambda: [][1]))).name == "user_error"


def _reraise(e: BaseException) -> None:
    raise RuntimeError("checkpoint save failed") from e


def test_exit_states_without_logs() -> None:
    assert classify(Evidence(exit_code=causes.HANG_EXIT_CODE)).name == "hang"
    assert classify(Evidence(exit_code=-signal.SIGTERM)).name == "preemption"
    assert classify(Evidence(exit_code=-signal.SIGINT)).name == "interrupted"  # Ctrl-C, ended at once
    assert classify(from_exception(KeyboardInterrupt())).name == "interrupted"
    assert classify(Evidence(exit_code=-signal.SIGKILL)).detail == "killed by SIGKILL"
    assert classify(Evidence(requeued_silently=True)).name == "node_failure"
    assert classify(Evidence()).name == "unknown"


def test_rules_form_a_registry_of_known_causes() -> None:
    assert {r.cause for r in causes.RULES} == set(CAUSES) - {"unknown"}
    with pytest.raises(ValueError, match="unknown cause"):
        causes.rule("gremlins", 1)


def test_ledger_keeps_one_cause_per_attempt_and_a_better_witness_wins(tmp_path: Path) -> None:
    from pipeline.reporting.html import run_report
    from pipeline.reporting.status import format_status, run_status

    ledger = Ledger(tmp_path)
    ledger.event("started", "pretrain")
    ledger.update("pretrain", status=FAILED, attempts=1, error="RuntimeError: Connection closed by peer")
    ledger.add_failure("pretrain", classify(Evidence(log=CASES["drill_dp2_rank1_killed"]["log"])), "job")
    ledger.add_failure("pretrain", classify(Evidence(exit_code=causes.HANG_EXIT_CODE)), "watchdog")
    ledger.add_failure("pretrain", classify(Evidence(message="IndexError")), "submitter")  # weaker: ignored
    ledger.event("failed", "pretrain")
    rec = ledger.read("pretrain")
    assert rec is not None and [(f["attempt"], f["cause"]) for f in rec.failures] == [(1, "hang")]
    text = format_status(tmp_path, run_status(tmp_path))
    assert "attempt 1 failed: hang (exit code 86 (the hang watchdog); seen by watchdog)" in text
    html = run_report(tmp_path)
    assert "cause hang" in html and '<table class="failures">' in html
