"""How a stage attempt that did not complete is recorded, by the job's rank 0 (or a hung rank's watchdog):
stopped on Ctrl-C, cancelled (``pipeline.cancel``, or a user's own ``scancel``), requeued on a stop signal
or with nodes excluded, restarted inside the job, requeued after a crash while requeues are left, or failed.
The cause of each failed attempt goes into the ledger (pipeline.records.causes)."""

from __future__ import annotations

import time
import traceback

from pipeline.records.causes import HANG_EXIT_CODE, Evidence, classify, from_exception
from pipeline.records.ledger import ACTIVE, CANCELLED, FAILED, REQUEUED, STOPPED, Ledger
from pipeline.schema.config import PipelineConfig
from pipeline.slurm.job_env import cancelled_by_scancel, requeue_excluding, requeue_self, restart_count
from pipeline.slurm.queries import exclude_nodes


def record_hang(ledger: Ledger, stage: str, injob_left: int) -> None:
    """A hung rank's watchdog, just before it exits: the attempt's cause is a hang (any rank may write); with
    in-job restarts left its supervisor starts it again (an ``injob_restart`` event)."""
    ledger.add_failure(stage, classify(Evidence(exit_code=HANG_EXIT_CODE)), "watchdog")
    if injob_left > 0:
        ledger.event("injob_restart", stage, error="hang: the watchdog saw no progress", left=injob_left)


def record_failure(
    ledger: Ledger, stage: str, cfg: PipelineConfig, e: BaseException, injob_left: int = 0
) -> None:
    """Ledger entry for a stage that did not complete: stopped on a signal, requeued, restarted inside the job
    (``injob_left``: in-job restarts left; pipeline/submit/injob.py starts the ranks again), or failed."""
    from engine.runtime.health import NodesExcluded
    from engine.runtime.signals import Interrupted, Preempted

    err = f"{type(e).__name__}: {e}"
    rec = ledger.read(stage)
    if rec and rec.status == CANCELLED:  # python -m pipeline.cancel: stopping is expected, never requeue
        ledger.event("stopped", stage, error=err, reason="cancelled")
        return
    if isinstance(e, Preempted) and not isinstance(e, Interrupted) and cancelled_by_scancel():
        # a user's own scancel (SIGTERM, as a preemption sends): their decision, never requeued
        ledger.update(stage, status=CANCELLED, ended_at=time.time(), error=f"cancelled by scancel ({err})")
        ledger.event("stopped", stage, error=err, reason="cancelled", by="scancel")
        return
    ledger.add_failure(stage, classify(from_exception(e)), "job")
    if isinstance(e, Interrupted | KeyboardInterrupt):  # Ctrl-C: stop here, never requeue; a re-run resumes
        step = e.step if isinstance(e, Interrupted) else None
        extra = {**(rec.extra if rec else {}), "stopped_at_step": step}
        ledger.update(stage, status=STOPPED, ended_at=time.time(), error=err, extra=extra)
        ledger.event("stopped", stage, error=err, reason="interrupted", step=step)
        return
    if isinstance(e, NodesExcluded):
        _requeue_without(ledger, stage, cfg, e.nodes, err)
        return
    if isinstance(e, Preempted):
        requeued = requeue_self(f"stopped by signal {e}")
        ledger.update(stage, status=REQUEUED if requeued else STOPPED, ended_at=time.time(), error=err)
        ledger.event("requeued" if requeued else "stopped", stage, error=err)
        return
    if injob_left > 0:  # the task's supervisor starts every rank again, in this allocation
        ledger.update(stage, error=err)
        ledger.event("injob_restart", stage, error=err, left=injob_left)
        return
    if restart_count() < cfg.cluster.max_requeues and requeue_self(f"crashed: {err}"):
        ledger.update(stage, status=REQUEUED, error=err)
        ledger.event("requeued", stage, error=err, traceback=traceback.format_exc(limit=20))
        return
    ledger.update(stage, status=FAILED, ended_at=time.time(), error=err)
    ledger.event("failed", stage, error=err, traceback=traceback.format_exc(limit=20))


def _requeue_without(
    ledger: Ledger, stage: str, cfg: PipelineConfig, nodes: dict[str, str], err: str
) -> None:
    """cluster.health.policy=exclude named ``nodes``: remembered for the run, this job requeued without them,
    and the run's other pending jobs (later stages) kept off them too."""
    every = ledger.exclude_nodes(nodes)
    others = [
        j
        for s, r in ledger.records(list(cfg.run.stages)).items()
        if s != stage and r is not None and r.status in ACTIVE
        for j in r.job_ids
    ]
    updated = exclude_nodes(others, sorted(every))
    requeued = requeue_excluding(sorted(every), err)
    ledger.update(stage, status=REQUEUED if requeued else FAILED, ended_at=time.time(), error=err)
    ledger.event("node_excluded", stage, nodes=nodes, excluded=sorted(every), requeued=requeued, jobs=updated)


def record_part_failure(ledger: Ledger, stage: str, cfg: PipelineConfig, e: BaseException, part: str) -> None:
    """A part's job did not finish: requeue it while requeues are left (a stop signal always), else the stage
    failed, naming the part (its gathering job will not run; a re-run redoes only the parts without a result)."""
    err = f"{type(e).__name__}: {e}"
    rec = ledger.read(stage)
    if rec and rec.status == CANCELLED:
        ledger.event("stopped", stage, part=part, error=err, reason="cancelled")
        return
    preempted = is_preempted(e)
    if preempted and cancelled_by_scancel():  # a user's own scancel of the part's job: never requeued
        ledger.event("stopped", stage, part=part, error=err, reason="cancelled", by="scancel")
        return
    if (preempted or restart_count() < cfg.cluster.max_requeues) and requeue_self(f"part {part}: {err}"):
        ledger.event("part_requeued", stage, part=part, error=err)
        return
    ledger.add_failure(stage, classify(from_exception(e)), "job")
    ledger.update(stage, status=FAILED, ended_at=time.time(), error=f"part {part!r} failed: {err}")
    ledger.event("part_failed", stage, part=part, error=err, traceback=traceback.format_exc(limit=20))


def is_preempted(e: BaseException) -> bool:
    from engine.runtime.signals import Preempted

    return isinstance(e, Preempted)
