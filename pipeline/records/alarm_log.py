"""Alarm lines of the training stages (written by engine/callbacks/alarms.py into metrics.jsonl).

``read_alarms(run_dir, stage)`` lists them; ``forward_alarms(ledger, stage)`` copies those not yet in the
run's events.jsonl there as ``alarm`` events (called by pipeline.submit.launch on rank 0 when a stage's job ends).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.records.ledger import Ledger, read_metrics


def read_alarms(run_dir: Path, stage: str) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir, stage) if r.get("kind") == "alarm"]


def forward_alarms(ledger: Ledger, stage: str) -> int:
    """Append the stage's alarms missing from events.jsonl as ``alarm`` events; returns how many."""
    seen = {(e.get("stage"), e.get("alarm_time")) for e in ledger.events() if e.get("event") == "alarm"}
    new = [a for a in read_alarms(ledger.run_dir, stage) if (stage, a.get("time")) not in seen]
    for a in new:
        ledger.event(
            "alarm",
            stage,
            alarm=a.get("alarm"),
            step=a.get("step"),
            message=a.get("message"),
            alarm_time=a.get("time"),
        )
    return len(new)


def format_alarm(a: dict[str, Any]) -> str:
    return f"ALARM {a.get('alarm')} at step {a.get('step')}: {a.get('message')}"
