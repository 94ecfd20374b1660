"""Run a validated config: decide what the ledger says is done, submit the rest, follow it, report.

Local and debug executors run the stages one after another while this process waits (submitit's local
executor knows no dependencies); the SLURM executor submits the whole graph at once with ``afterok``
dependencies and returns.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pipeline.records import progress
from pipeline.records.causes import Evidence, classify, read_logs
from pipeline.records.ledger import ACTIVE, CANCELLED, COMPLETED, FAILED, STOPPED, Ledger, StageRecord
from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import SPECS, dependencies, order, parts, required
from pipeline.schema.identity import run_dir_for, stage_hashes
from pipeline.schema.layout import stage_plan
from pipeline.submit import interrupt, prefork
from pipeline.submit.launch import (
    free_port,
    make_executor,
    mark_submitted,
    pending_parts,
    run_stage,
    sbatch_script,
    stage_out_dir,
)
from pipeline.submit.slurm import SubmitError

__all__ = ["RunError", "SubmitError", "execute", "run_dir_for"]

POLL_S = 0.05
"""How often a local job is checked (its controller process's exit code) and its metrics followed: the next
stage is submitted this long after the previous one's processes have exited, at most."""


class RunError(RuntimeError):
    """The run cannot go on (a stage failed or an input is missing); the message says where to look."""


@dataclass
class Decision:
    """What to do with each selected stage."""

    skip: list[str] = field(default_factory=list)
    active: list[str] = field(default_factory=list)
    submit: list[str] = field(default_factory=list)


def decide(cfg: PipelineConfig, ledger: Ledger, alive: Any = None) -> Decision:
    """Skip stages completed with the same hash; leave live ones alone; submit the rest and their dependents."""
    hashes = stage_hashes(cfg)
    selected = order(cfg.run.stages)
    d = Decision()
    for s in selected:
        rec = ledger.read(s)
        if any(u in d.submit for u in dependencies(s, selected)):
            d.submit.append(s)
        elif rec and rec.status == COMPLETED and rec.hash == hashes[s]:
            d.skip.append(s)
        elif rec and rec.status in ACTIVE and rec.hash == hashes[s] and alive is not None and alive(rec):
            d.active.append(s)
        else:
            d.submit.append(s)
    for s in d.submit:
        for u in required(s, cfg):
            if u in selected:
                continue
            rec = ledger.read(u)
            if not (rec and rec.status == COMPLETED and rec.hash == hashes[u]):
                raise RunError(
                    f"stage {s!r} needs {u!r}, which is not completed in {ledger.run_dir} with this config; "
                    f"add it to run.stages (e.g. run.stages=[{u},{s}])"
                )
    return d


def execute(cfg: PipelineConfig, *, out: TextIO | None = None) -> int:
    """Plan, submit and (for local/debug) follow one run. Returns a process exit code."""
    out = out or sys.stdout
    run_dir = run_dir_for(cfg)
    if cfg.run.dry_run:
        return dry_run(cfg, run_dir, out)
    if cfg.cluster.executor == "slurm":
        from pipeline.submit.slurm import check_slurm

        check_slurm()  # no sbatch, or the controller does not answer: stop before writing anything
    fresh = not run_dir.exists()
    ledger = Ledger(run_dir)
    d = decide(cfg, ledger, alive=_job_alive)
    print(f"run directory: {run_dir}", file=out)
    for s in d.skip:
        print(f"[{s}] completed earlier with the same config: skipped", file=out)
    for s in d.active:
        rec = ledger.read(s)
        print(
            f"[{s}] already queued or running (job {', '.join(rec.job_ids) if rec else '?'}): nothing submitted",
            file=out,
        )
    if d.active and cfg.cluster.executor != "slurm":
        print(
            f"nothing submitted: stage(s) {', '.join(d.active)} run in another local job that this command "
            "does not follow; re-run this command once it has ended (python -m pipeline.status shows it)",
            file=out,
        )
        return 4
    if not d.submit:
        print("nothing submitted: every selected stage is completed or already queued/running", file=out)
        ledger.event("nothing_to_do")
        return summarize(cfg, run_dir, out)
    _write_provenance(cfg, run_dir)
    if cfg.cluster.executor == "slurm":
        from pipeline.submit.slurm import submit_graph

        try:
            return submit_graph(cfg, run_dir, d.submit, out=out)
        except SubmitError as e:
            if fresh and e.submitted == 0:  # SLURM took nothing: leave nothing behind
                import shutil

                shutil.rmtree(run_dir, ignore_errors=True)
            else:
                print(
                    f"run directory: {run_dir} (python -m pipeline.status reads it; re-run to resubmit)",
                    file=out,
                )
            raise
    with interrupt.catching() as presses:  # Ctrl-C: stop with the work kept (pipeline.submit.interrupt)
        with interrupt.ignoring_sigint():
            server = _start_prefork(cfg, run_dir, d.submit)
        try:
            for s in d.submit:
                python = server.python if server and SPECS[s].torch else None
                for part, _ in pending_parts(cfg, run_dir, s, d.submit, out):  # then the stage's job gathers
                    _run_one_local(cfg, s, run_dir, ledger, out, presses, python=python, part=part)
                _run_one_local(cfg, s, run_dir, ledger, out, presses, python=python)
        finally:
            if server:
                server.close()
    return summarize(cfg, run_dir, out)


def _start_prefork(
    cfg: PipelineConfig, run_dir: Path, stages: list[str]
) -> prefork.Server | prefork.Attached | None:
    if cfg.cluster.executor != "local" or not cfg.cluster.prefork:
        return None
    if not any(SPECS[s].torch for s in stages):  # data_prep alone: nothing to import ahead
        return None
    if cfg.cluster.prefork_socket:  # a server someone else owns (a search's controller)
        return prefork.Attached(Path(cfg.cluster.prefork_socket))
    return prefork.start(run_dir / "jobs" / "prefork.log")


def _run_one_local(
    cfg: PipelineConfig,
    stage: str,
    run_dir: Path,
    ledger: Ledger,
    out: TextIO,
    presses: interrupt.Presses,
    python: str | None = None,
    part: str | None = None,
) -> None:
    """Run one local job (the stage's, or one ``part`` of it) and wait for it, following its metrics; after
    Ctrl-C (``presses``) raise ``interrupt.Stopped`` once it has ended."""
    ex = make_executor(cfg, stage, run_dir, python=python)
    label = f"{stage}:{part}" if part else stage
    if presses.count:
        raise interrupt.Stopped(f"[{label}] not started (Ctrl-C); run the same command again to continue")
    port = free_port()
    mark_submitted(cfg, ledger, stage, cfg.cluster.executor)
    with interrupt.ignoring_sigint():  # the job's controller and tasks: no KeyboardInterrupt of their own
        job = ex.submit(run_stage, stage, cfg.to_dict(), str(run_dir), port, part)
    rec = ledger.read(stage)
    extra = {
        **(rec.extra if rec else {}),
        "job_start": _process_start(str(job.job_id)),
        "stopped_at_step": None,
    }
    ledger.update(stage, job_ids=[str(job.job_id)], log=str(job.paths.stdout), extra=extra)
    ledger.event("submitted", stage, job_id=str(job.job_id), **({"part": part} if part else {}))
    follower = progress.Follower(label, stage_out_dir(run_dir, stage) / "metrics.jsonl", out=out)
    grace_s, killed = cfg.cluster.interrupt_grace_s, False
    try:
        if cfg.cluster.executor == "debug":
            job.results()
        else:
            killed = interrupt.follow(job, follower.poll, presses, grace_s, POLL_S)
            if not presses.count:  # after Ctrl-C the ledger tells (a killed or interrupted job may leave no
                job.results()  # result file, which submitit waits seconds for)
    except Exception as e:
        if presses.count or _stopped_on_ctrl_c(ledger.read(stage)):
            raise _interrupted(ledger, stage, label, presses, killed, grace_s) from None
        follower.poll()
        log = job.paths.stderr if cfg.cluster.executor == "local" else None
        rec = ledger.read(stage)
        if rec and rec.status == STOPPED:
            raise RunError(
                f"stage {stage!r} stopped on a signal after saving a checkpoint; re-run the same command to resume"
            ) from None
        if rec and rec.status != FAILED:  # killed: the job could not say so itself
            ledger.update(
                stage, status=FAILED, ended_at=time.time(), error=f"{type(e).__name__}: {_last_error(e)}"
            )
        if rec and rec.status != CANCELLED:  # every rank's log: what rank 0 alone may not have seen
            ledger.add_failure(stage, classify(Evidence(log=read_logs(job.paths.folder))), "submitter")
        reason = _diagnose(job.paths.folder) or _last_error(e)
        what = f"stage {stage!r}" + (f" (part {part!r})" if part else "")
        raise RunError(f"{what} failed: {reason}\n  log: {log or 'see above'}") from None
    if presses.count or _stopped_on_ctrl_c(ledger.read(stage)):  # debug: the stage took the press itself
        raise _interrupted(ledger, stage, label, presses, killed, grace_s)
    follower.poll(final=True)


def _stopped_on_ctrl_c(rec: StageRecord | None) -> bool:
    """The stage saved and stopped on SIGINT itself (the debug executor's in-process stage takes the press
    from the command's counter while its loop runs)."""
    return bool(
        rec and rec.status == STOPPED and rec.failures and rec.failures[-1].get("cause") == "interrupted"
    )


def _interrupted(
    ledger: Ledger, stage: str, label: str, presses: interrupt.Presses, killed: bool, grace_s: float
) -> interrupt.Stopped:
    """A job that ended after Ctrl-C: the line to print. A stage that saved and stopped recorded it itself;
    one the command ended at once (``killed``), or that ended otherwise, is recorded here."""
    rec = ledger.read(stage)
    if not killed and rec and rec.status == STOPPED:
        return interrupt.Stopped(interrupt.saved_line(label, rec.extra.get("stopped_at_step")))
    if not killed and rec and rec.status == COMPLETED:
        return interrupt.Stopped(
            f"[{label}] completed before Ctrl-C could stop it; run the same command again"
        )
    ledger.add_failure(stage, classify(Evidence(signal=signal.SIGINT)), "submitter")
    ledger.update(stage, status=STOPPED, ended_at=time.time(), error="stopped on Ctrl-C before it saved")
    ledger.event("stopped", stage, reason="interrupted", at_once=killed)
    if killed:
        return interrupt.Stopped(interrupt.killed_line(label, presses, grace_s))
    return interrupt.Stopped(interrupt.saved_line(label, None))


def _diagnose(folder: Path) -> str | None:
    """The most telling line of a failed local job's logs (every rank): a hang, an injected fault, an error."""
    lines: list[str] = []
    for p in sorted(Path(folder).glob("*_log.err")):
        lines += [ln.strip() for ln in p.read_text(errors="replace").splitlines()]
    for key in ("HangDetected", "InjectedFault", "Error:", "Exception:"):
        hits = [ln for ln in lines if key in ln and not ln.startswith("File ")]
        if hits:
            return hits[-1]
    return None


def _last_error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    tail = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    return (tail or lines or [type(e).__name__])[-1].strip()


def _job_alive(rec: StageRecord) -> bool:
    """Is the job behind a queued/running record still alive? (local: its process; slurm: squeue/sacct)."""
    if rec.executor == "slurm":
        from pipeline.submit.slurm import slurm_job_alive

        return any(slurm_job_alive(j) for j in rec.job_ids)
    if rec.executor == "local":
        start = rec.extra.get("job_start") if rec.extra else None
        return any(start is not None and _process_start(j) == start for j in rec.job_ids)
    return False


def _process_start(pid: str) -> float | None:
    """Start time of live process ``pid`` (the local job's controller); None if gone or a zombie.

    A local job is alive while the process that was started for it runs: the PID alone is not enough
    (a killed job stays a zombie for a while, and a PID can be reused), so its start time is recorded at
    submission and compared.
    """
    import psutil

    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except (ValueError, psutil.Error):
        return None


def dry_run(cfg: PipelineConfig, run_dir: Path, out: TextIO) -> int:
    """Print each selected stage's layout and the sbatch script that would be submitted."""
    print(f"dry run (nothing submitted): run directory would be {run_dir}", file=out)
    for s in order(cfg.run.stages):
        plan = stage_plan(cfg, s)
        for part, reads in parts(s, cfg):  # each its own job of the stage's layout, before the stage's own
            print(f"\n=== {s}:{part}: a job of its own after {', '.join(reads)}", file=out)
        print(f"\n=== {s}: {plan.as_dict()}", file=out)
        print(sbatch_script(cfg, s, run_dir, run_dir / "code" / "<submission>"), file=out)
    return 0


def summarize(cfg: PipelineConfig, run_dir: Path, out: TextIO) -> int:
    """Print the results table (if eval ran) and where everything was written."""
    ledger = Ledger(run_dir)
    results = stage_out_dir(run_dir, "eval") / "results.json"
    from pipeline.reporting.html import left_out

    if results.exists():
        from pipeline.reporting.results import results_table

        print("\n" + results_table(results), file=out)
    print(f"\nrun directory: {run_dir}", file=out)
    for s in order(cfg.run.stages):
        rec = ledger.read(s)
        status = rec.status if rec else "not run"
        print(f"  {s:<10} {status:<10} {stage_out_dir(run_dir, s)}", file=out)
        if s == "data_prep" and rec and rec.status == COMPLETED:
            print(data_counts_lines(rec.outputs), file=out, end="")
        if rec and rec.status == COMPLETED and (rec.outputs.get("truncation") or {}).get("emptied"):
            print(f"    left out by truncation: {left_out(rec.outputs)}", file=out)
    _write_report(run_dir, out)
    bad = [s for s in cfg.run.stages if (r := ledger.read(s)) and r.status in (FAILED, CANCELLED)]
    return 1 if bad else 0


def _write_report(run_dir: Path, out: TextIO) -> None:
    """The run's HTML report (pipeline.reporting.html); a failure to write it is reported, never fatal."""
    from pipeline.reporting.html import write_report

    try:
        print(f"report: {write_report(run_dir)}", file=out)
    except Exception as e:  # the run's result does not depend on its report
        print(f"report: not written ({type(e).__name__}: {e})", file=out)


def data_counts_lines(outputs: dict[str, Any]) -> str:
    """data_prep's cleaning counts per source (corpus=sources), one line each, for the summary."""
    lines = ""
    for name, c in (outputs.get("sources") or {}).items():
        dropped = ", ".join(
            f"{k} {c[k]}" for k in ("duplicates", "malformed", "empty", "too_short", "too_long") if c.get(k)
        )
        lines += (
            f"    {name}: {c.get('documents', 0) - c.get('duplicates', 0)} documents kept"
            + (f" (dropped: {dropped})" if dropped else "")
            + "\n"
        )
    return lines


def _write_provenance(cfg: PipelineConfig, run_dir: Path) -> None:
    from pipeline.submit.provenance import write_provenance

    write_provenance(cfg, run_dir)


def write_sweep_report(root: str) -> None:
    """After a sweep (``-m``): one report across the run directories under ``run.root``."""
    from pipeline.reporting.html import write_report

    try:
        print(f"sweep report: {write_report(Path(root))}")
    except Exception as e:
        print(f"sweep report: not written ({type(e).__name__}: {e})")
