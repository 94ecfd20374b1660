"""The labelled failure logs of tests/records/failure_logs: how they were captured and how a test reads them.

Each case is one JSON file: ``label`` (the cause it must be classified as), ``source`` (how it was made),
and the evidence as the pipeline saw it: ``error`` (the ledger's error line, rank 0's exception), ``log`` (the
end of every rank's stderr), optional ``exit_code`` / ``slurm_state``. ``capture`` makes one from a drill's
run directory (``python -m tests.support.failure_logs <run_dir> <label> <name> <source>``), keeping the last
``TAIL`` lines of each rank's log so the files stay small.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pipeline.records.causes import Evidence
from pipeline.records.ledger import Ledger

DIR = Path(__file__).resolve().parents[1] / "records" / "data" / "failure_logs"
TAIL = 25


def capture(run_dir: Path, label: str, source: str, stage: str = "pretrain") -> dict[str, Any]:
    rec = Ledger(run_dir).read(stage)
    logs = []
    for p in sorted((Path(run_dir) / "jobs" / stage).glob("*/*_log.err")):
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if "Warning" not in ln]
        logs.append(f"==> rank log {p.name[p.name.index('_') + 1 :]} <==\n" + "\n".join(lines[-TAIL:]))
    return {"label": label, "source": source, "error": rec.error if rec else "", "log": "\n".join(logs)}


def cases() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DIR.glob("*.json"))}


def evidence(case: dict[str, Any]) -> Evidence:
    """The evidence of a case as the job and the submitter together saw it."""
    exc, _, msg = (case.get("error") or "").partition(": ")
    return Evidence(
        exception=exc if exc.isidentifier() else "",
        message=msg,
        log=case.get("log", ""),
        exit_code=case.get("exit_code"),
        slurm_state=case.get("slurm_state", ""),
    )


if __name__ == "__main__":
    run, label, name, source = sys.argv[1:5]
    (DIR / f"{name}.json").write_text(json.dumps(capture(Path(run), label, source), indent=1) + "\n")
