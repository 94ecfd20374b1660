"""Each stage's state from the ledger and the scheduler.

Shows pending / running / completed / failed / requeued (with count), where the logs are, and why a stage
failed (or which upstream failure keeps it from running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.records.alarm_log import format_alarm, read_alarms
from pipeline.records.causes import Evidence, classify, read_logs
from pipeline.records.ledger import ACTIVE, CANCELLED, COMPLETED, FAILED, Ledger, StageRecord, accounting
from pipeline.schema.graph import STAGES, upstream
from pipeline.slurm.queries import ALIVE_STATES, job_state

BLOCKED = "blocked"
"""Shown for a stage that will never run because an upstream stage failed (its job cancelled or pending)."""
TERMINAL_BAD = {"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class StageView:
    """One stage's state as a user should see it."""

    stage: str
    state: str
    detail: str = ""
    requeues: int = 0
    log: str | None = None
    job_ids: str = ""
    stderr: str | None = None
    accounting: str = ""
    alarms: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    """One line per failed attempt: its cause and the evidence (pipeline.records.causes)."""


def view(rec: StageRecord | None, stage: str) -> StageView:
    """Merge the ledger record with the scheduler's view of its job."""
    if rec is None:
        return StageView(stage, "not run")
    stderr = rec.extra.get("stderr") if rec.extra else None
    v = StageView(stage, rec.status, rec.error or "", rec.requeues, rec.log, ",".join(rec.job_ids), stderr)
    v.causes = [format_failure(f) for f in rec.failures]
    if rec.executor != "slurm" or rec.status not in ACTIVE or not rec.job_ids:
        return v
    state, reason, runs = job_state(rec.job_ids[-1])
    v.requeues = max(v.requeues, runs - 1)
    _apply_slurm_state(v, rec, state, reason, runs)
    if v.state == BLOCKED and rec.extra.get("parts"):
        v.detail = _parts_detail(rec.extra["parts"]) or v.detail
    if v.state == FAILED and not any(f.get("attempt") == rec.attempts for f in rec.failures):
        logs = read_logs(Path(rec.log).parent) if rec.log else ""  # the job could not say why: SLURM can
        v.causes.append(
            format_failure({"attempt": rec.attempts, "seen_by": "scheduler", **_slurm_cause(state, logs)})
        )
    return v


def _parts_detail(parts: dict[str, str]) -> str:
    """Which of a stage's part jobs (pipeline.schema.graph ``Stage.parts``) keep its own job from running."""
    bad = {p: job_state(j)[0] for p, j in parts.items()}
    bad = {p: st for p, st in bad.items() if st not in ALIVE_STATES and st != "COMPLETED"}
    if not bad:
        return ""
    named = ", ".join(f"{p} (job {parts[p]}: {st})" for p, st in bad.items())
    return f"will not run: part {named} did not complete; re-run the same command to redo only those"


def _slurm_cause(state: str, logs: str) -> dict[str, str]:
    return classify(Evidence(slurm_state=state, log=logs)).as_dict()


def format_failure(f: dict[str, Any]) -> str:
    """``attempt 2 failed: hang (exit code 86 (the hang watchdog); seen by watchdog)``."""
    return (
        f"attempt {f.get('attempt')} failed: {f.get('cause')} ({f.get('detail')}; seen by {f.get('seen_by')})"
    )


def _apply_slurm_state(v: StageView, rec: StageRecord, state: str, reason: str, runs: int) -> None:
    """Set ``v.state``/``v.detail`` from the SLURM state of the job behind an active ledger record."""
    if state == "PENDING" and "DependencyNeverSatisfied" in reason:
        v.state, v.detail = BLOCKED, "will not run: an upstream stage failed"
    elif state == "PENDING":
        v.state, v.detail = ("requeued" if runs > 1 else "pending"), reason
    elif state in ("REQUEUED", "NODE_FAIL", "PREEMPTED", "REQUEUE_HOLD"):
        v.state, v.detail = "requeued", state
    elif state == "CANCELLED" and rec.started_at is None:
        v.state, v.detail = BLOCKED, "job cancelled before it started (an upstream stage failed, or scancel)"
    elif state == "CANCELLED":
        v.state, v.detail = CANCELLED, "job cancelled while running (scancel)"
    elif state in TERMINAL_BAD:
        v.state, v.detail = FAILED, f"SLURM state {state}" + (f" ({reason})" if reason != "None" else "")
    elif state == "RUNNING":
        v.state = "running"
    elif state == "COMPLETED" and rec.status != COMPLETED:
        v.state, v.detail = FAILED, "job ended without completing the stage"


def _name_blockers(views: list[StageView]) -> None:
    """Name the failed stage that keeps each blocked stage from running (views in graph order)."""
    root = {v.stage: v.stage for v in views if v.state == FAILED}
    for v in views:
        cause = next((root[u] for u in upstream(v.stage) if u in root), None)
        if v.state == BLOCKED and cause is not None:
            root[v.stage] = cause
            v.detail = f"will not run: upstream stage {cause} failed"


def format_accounting(acc: dict[str, Any], attempts: int) -> str:
    down = ", ".join(f"{d:.0f}s" for d in acc["down_s"]) or "-"
    text = (
        f"attempts {attempts}, resumes {acc['resumes']}, steps lost {acc['steps_lost']}, "
        f"failure-to-training {down}, {acc['checkpoints']} checkpoint(s) "
        f"{acc['checkpoint_save_s_total']:.1f}s total (max {acc['checkpoint_save_s_max']:.1f}s)"
    )
    auto = acc.get("save_interval")
    if auto:
        text += (
            f"; save_interval auto: {auto['interval']} steps (stall {auto['stall_s']:.2f}s {auto['source']}, "
            f"step {auto['step_s']:.3g}s, a failure every {auto['mtbf_h']:.3g}h on {auto['nodes']} node(s))"
        )
    if acc.get("goodput") is not None:
        text += f"; goodput {acc['goodput']:.1%} measured"
    return text


def _add_accounting(run_dir: Path, ledger: Ledger, views: list[StageView]) -> None:
    for v in views:
        rec = ledger.read(v.stage)
        acc = accounting(run_dir, v.stage)
        if rec and (acc["checkpoints"] or acc["resumes"] or rec.attempts > 1):
            v.accounting = format_accounting(acc, rec.attempts)


def run_status(run_dir: Path) -> list[StageView]:
    ledger = Ledger(run_dir)
    views = [view(rec, s) for s in STAGES if (rec := ledger.read(s)) is not None]
    _name_blockers(views)
    _add_accounting(run_dir, ledger, views)
    for v in views:
        v.alarms = [format_alarm(a) for a in read_alarms(run_dir, v.stage)]
    return views


def format_status(run_dir: Path, views: list[StageView]) -> str:
    lines = [f"run directory: {run_dir}", f"{'stage':<10} {'state':<10} {'job':<10} {'requeues':>8}  detail"]
    for v in views:
        lines.append(f"{v.stage:<10} {v.state:<10} {v.job_ids:<10} {v.requeues:>8}  {v.detail}")
        if v.state == FAILED:
            lines += [f"{'':<10} log: {v.log}"] + ([f"{'':<10} stderr: {v.stderr}"] if v.stderr else [])
        if v.accounting:
            lines.append(f"{'':<10} {v.accounting}")
        lines += [f"{'':<10} {c}" for c in v.causes]
        lines += [f"{'':<10} {a}" for a in v.alarms[-5:]]
        if len(v.alarms) > 5:
            lines.append(f"{'':<10} ({len(v.alarms) - 5} earlier alarm(s) in {v.stage}'s metrics.jsonl)")
    for host, why in sorted(Ledger(run_dir).excluded_nodes().items()):
        lines.append(f"excluded node: {host} ({why}; cluster.health.policy=exclude)")
    failed = [v for v in views if v.state == FAILED]
    if failed:
        lines.append(
            f"failed stage: {failed[0].stage}, log {failed[0].stderr or failed[0].log} "
            "(re-run the same command to resubmit it and its dependents)"
        )
    return "\n".join(lines)


ACTIVE_VIEW = ("submitted", "pending", "running", "requeued")


def live_lines(run_dir: Path, views: list[StageView], every: float) -> str:
    """For --watch: each active stage's newest progress line (step, loss, tokens/s, MFU, memory, ETA)."""
    from pipeline.records.progress import format_record, last_record

    lines = []
    for v in views:
        if v.state in ACTIVE_VIEW:
            rec = last_record(Path(run_dir) / "stages" / v.stage / "metrics.jsonl", "train")
            lines.append((rec and format_record(v.stage, rec)) or f"[{v.stage}] no step yet")
    stamp = time.strftime("%H:%M:%S")
    return "\n".join(lines + [f"refreshed {stamp}, every {every:g} s (Ctrl-C to quit)"])
