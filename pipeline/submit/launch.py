"""Submission: one submitit job per stage (local | debug | slurm), resources derived from the parallel plan.

The submitting side builds executors and submits ``run_stage``; the job side (``run_stage``, on every rank)
sets the torch.distributed variables from submitit's JobEnvironment, marks the ledger and calls
``stages.<stage>.main(cfg, ctx)``. Nothing here imports torch or megatron at module level.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, MutableMapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pipeline.records.alarm_log import forward_alarms
from pipeline.records.causes import Evidence, classify
from pipeline.records.ledger import (
    COMPLETED,
    RUNNING,
    SUBMITTED,
    Ledger,
    StageRecord,
)
from pipeline.records.parts import read_part
from pipeline.schema.build import from_dict
from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import parts, spec, upstream
from pipeline.schema.identity import stage_hashes
from pipeline.schema.layout import ParallelPlan, stage_plan
from pipeline.slurm.job_env import (  # noqa: F401  (free_port re-exported)
    RELAY_ENV,
    cancelled_by_scancel,
    free_port,
    in_slurm_job,
    requeue_excluding,
    requeue_self,
    restart_count,
)
from pipeline.submit.outcomes import is_preempted, record_failure, record_hang, record_part_failure

if TYPE_CHECKING:
    from engine.context import DistEnv, StageContext

CODE_DIRS = ("pipeline", "stages", "engine", "conf")
REPO_ROOT = Path(__file__).resolve().parents[2]


def stage_out_dir(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / "stages" / stage


def job_folder(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / "jobs" / stage


def snapshot_code(run_dir: Path) -> Path:
    """Copy the code into the run directory so queued jobs run it as it was when submitted."""
    dest = Path(run_dir) / "code" / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    tmp = dest.with_name(dest.name + ".tmp")
    for d in CODE_DIRS:
        if not (REPO_ROOT / d).is_dir():
            continue  # an installed wheel: conf/ travels inside pipeline/
        shutil.copytree(REPO_ROOT / d, tmp / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    tmp.rename(dest)
    return dest


# ---------------------------------------------------------------------------- executors


def excluded(run_dir: Path) -> list[str]:
    """The nodes the run's jobs keep off (cluster.health.policy=exclude named them)."""
    return sorted(Ledger(run_dir).excluded_nodes())


def slurm_parameters(
    cfg: PipelineConfig,
    stage: str,
    plan: ParallelPlan,
    code_dir: Path | None,
    exclude: list[str] | None = None,
) -> dict[str, Any]:
    """sbatch parameters for one stage, all derived from its plan, the cluster profile and the run's
    ``exclude``d nodes."""
    c = cfg.cluster
    st = cfg.stage(stage)
    setup = list(c.setup)
    env = dict(c.env)
    if code_dir is not None:
        setup += _code_setup(code_dir)
    setup += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items())]
    params: dict[str, Any] = {
        "job_name": f"{cfg.run.name}-{stage}",
        "nodes": plan.nodes,
        "ntasks_per_node": plan.tasks_per_node,
        "cpus_per_task": plan.cpus_per_task,
        "time": st.time_min or c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": setup,
        # a stage whose upstream failed is cancelled at once instead of pending forever (22.05's default)
        "additional_parameters": {"requeue": True, "kill_on_invalid_dep": "yes"},
    }
    if plan.gpus_per_node:
        params["gpus_per_node"] = plan.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            params[key] = getattr(c, key)
    if c.exclusive:
        params["exclusive"] = True
    if exclude:
        params["exclude"] = ",".join(exclude)
    if c.mem_gb:
        params["mem"] = f"{c.mem_gb}GB"
    srun_args = []
    if c.container_image:
        srun_args += [f"--container-image={c.container_image}", "--container-mounts=/:/"]
    if stage == "data_prep" and cfg.data_prep.launcher == "mpi":  # the tasks form one MPI world
        srun_args.append(f"--mpi={c.mpi}")
    if srun_args:
        params["srun_args"] = srun_args
    return params


def _code_setup(code_dir: Path) -> list[str]:
    """Shell lines making the job import the snapshot: first on PYTHONPATH, and the job's working directory
    (the submitter's, where a checkout may sit) kept off sys.path (``python -m`` would put it first)."""
    return [
        f"export PYTHONPATH={shlex.quote(str(code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "export PYTHONSAFEPATH=1",
    ]


def make_executor(
    cfg: PipelineConfig,
    stage: str,
    run_dir: Path,
    code_dir: Path | None = None,
    python: str | None = None,
) -> Any:
    """The submitit executor for one stage, with its resources set (``python``: the local tasks' command
    instead of this interpreter, e.g. a prefork relay)."""
    import submitit

    plan = stage_plan(cfg, stage)
    folder = job_folder(run_dir, stage) / "%j"
    kind = cfg.cluster.executor
    timeout = cfg.stage(stage).time_min or cfg.cluster.time_min
    if kind == "debug":
        return submitit.DebugExecutor(folder=folder)
    if kind == "local":
        ex = submitit.LocalExecutor(folder=folder, python=python)
        # data_prep.launcher=mpi: one task, which runs mpiexec -n dp (stages.data_prep)
        tasks = 1 if stage == "data_prep" and cfg.data_prep.launcher == "mpi" else plan.world_size
        ex.update_parameters(timeout_min=timeout, tasks_per_node=tasks, nodes=1)
        if plan.gpus_per_node:  # else submitit's controller hides every GPU (CUDA_VISIBLE_DEVICES="")
            ex.update_parameters(gpus_per_node=plan.gpus_per_node)
        return ex
    slurm = submitit.SlurmExecutor(
        folder=folder,
        max_num_timeout=cfg.cluster.max_requeues,
        python=_task_python(cfg.cluster.injob_restarts),
    )
    slurm.update_parameters(**slurm_parameters(cfg, stage, plan, code_dir, excluded(run_dir)))
    return slurm


def _task_python(injob_restarts: int) -> str:
    """The command each SLURM task runs submitit with: this interpreter, under the in-job restart supervisor
    when ``cluster.injob_restarts`` allows restarts (pipeline/submit/injob.py)."""
    python = shlex.quote(sys.executable)
    return f"{python} -m pipeline.submit.injob {injob_restarts} {python}" if injob_restarts else python


def sbatch_script(cfg: PipelineConfig, stage: str, run_dir: Path, code_dir: Path | None = None) -> str:
    """The sbatch script ``cluster=slurm`` would submit for ``stage`` (dry run): rendered by submitit's own
    SlurmExecutor, which needs no SLURM for that, only its constructor looks for ``srun``."""
    import submitit

    class Renderer(submitit.SlurmExecutor):  # type: ignore[misc]
        @classmethod
        def affinity(cls) -> int:  # submitit's "is srun on PATH": rendering a script needs no SLURM
            return 1

    plan = stage_plan(cfg, stage)
    ex = Renderer(folder=job_folder(run_dir, stage) / "%j", python="python3")
    ex.update_parameters(**slurm_parameters(cfg, stage, plan, code_dir, excluded(run_dir)))
    return str(ex._make_submission_file_text(ex._submitit_command_str, "dry-run"))


def pending_parts(
    cfg: PipelineConfig, run_dir: Path, stage: str, submitting: list[str], out: TextIO
) -> list[tuple[str, tuple[str, ...]]]:
    """``stage``'s parts (pipeline.schema.graph.parts) to run now: those without a result for this config,
    and every one that reads a stage run again in this submission. The others are reported to ``out`` as
    skipped."""
    identity, out_dir = stage_hashes(cfg)[stage], stage_out_dir(run_dir, stage)
    todo = []
    for part, reads in parts(stage, cfg):
        if set(reads) & set(submitting) or read_part(out_dir, part, identity) is None:
            todo.append((part, reads))
        else:
            print(f"[{stage}:{part}] done earlier with the same config: skipped", file=out)
    return todo


def mark_submitted(
    cfg: PipelineConfig, ledger: Ledger, stage: str, executor: str, **fields: Any
) -> StageRecord:
    """Record a (re)submission: fresh status, hashes and plan; attempts carry over only for the same config."""
    hashes = stage_hashes(cfg)
    if spec(stage).shared:  # keep the input digests for the job's ranks (size + mtime pre-check)
        from pipeline.schema.data_identity import fingerprints

        fingerprints(cfg, save=True)
    prev = ledger.read(stage)
    return ledger.update(
        stage,
        status=SUBMITTED,
        hash=hashes[stage],
        upstream={u: hashes[u] for u in upstream(stage)},
        executor=executor,
        submitted_at=time.time(),
        started_at=None,
        ended_at=None,
        error=None,
        requeues=0,
        plan=stage_plan(cfg, stage).as_dict(),
        attempts=prev.attempts if prev and prev.hash == hashes[stage] else 0,
        failures=prev.failures if prev and prev.hash == hashes[stage] else [],
        **fields,
    )


# ---------------------------------------------------------------------------- the job side


NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
"""Set in every job's environment unless the user set them: jobs reach no network on their own (MLflow 3
sends usage telemetry otherwise; DO_NOT_TRACK is the cross-tool convention)."""


def _job_environment(executor: str, given_port: int | None) -> tuple[DistEnv, str]:
    """(this rank's place, the job id) inside a submitit job."""
    import submitit

    from engine.context import DistEnv

    if executor == "debug":
        job_id = os.environ.get("SUBMITIT_DEBUG_JOB_ID", "debug")
        return DistEnv(0, 1, 0, "127.0.0.1", _rendezvous_port(job_id, given_port)), job_id
    env = submitit.JobEnvironment()
    master = env.hostnames[0] if executor == "slurm" else "127.0.0.1"
    job_id = str(env.job_id)
    port = _rendezvous_port(job_id, given_port)
    return DistEnv(env.global_rank, env.num_tasks, env.local_rank, master, port), job_id


RENDEZVOUS_PORTS = (20000, 32000)
"""A SLURM job's rendezvous port range: the same port on every rank, another for the next job; below Linux's
ephemeral range (32768 up), so no outgoing connection holds it (the local test cluster's daemons keep below it)."""


def _rendezvous_port(job_id: str, given: int | None) -> int:
    if given:
        return given
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    lo, hi = RENDEZVOUS_PORTS
    return lo + int(digits) % (hi - lo)


def export_job_env(environ: MutableMapping[str, str], dist: DistEnv) -> None:
    """The job process's environment for the libraries it runs: torch.distributed's env rendezvous
    variables (this rank's place; our own code gets it as StageContext.dist) and NO_TELEMETRY."""
    environ.update(
        RANK=str(dist.rank),
        WORLD_SIZE=str(dist.world_size),
        LOCAL_RANK=str(dist.local_rank),
        MASTER_ADDR=dist.master_addr,
        MASTER_PORT=str(dist.master_port),
    )
    for key, value in NO_TELEMETRY.items():
        environ.setdefault(key, value)


def run_stage(
    stage: str,
    cfg_dict: dict[str, Any],
    run_dir: str,
    master_port: int | None = None,
    part: str | None = None,
) -> dict[str, Any]:
    """Job entry point on every rank: set up the distributed environment, run the stage (or one of its
    ``part``s: pipeline.schema.graph ``Stage.parts``), mark the ledger.

    The job's facts (its place, attempt, restarts, fault specs) are read here once and handed to the stage
    in its StageContext; nothing below reads them from the environment."""
    from engine.runtime.fault_injection import ENV as FAULT_ENV
    from pipeline.submit.injob import INJOB_ENV, LEFT_ENV

    cfg = from_dict(cfg_dict)
    if cfg.cluster.executor != "debug":  # started with Ctrl-C ignored (pipeline.submit.interrupt): heed it
        signal.signal(signal.SIGINT, _interrupt_once)
    dist, job_id = _job_environment(cfg.cluster.executor, master_port)
    export_job_env(os.environ, dist)
    rank, world = dist.rank, dist.world_size
    ledger = Ledger(Path(run_dir))
    local_group = cfg.cluster.executor == "local" and world > 1
    injob = (int(os.environ.get(INJOB_ENV, "0")), int(os.environ.get(LEFT_ENV, "0")))  # (attempt, left)
    attempt = 0
    if rank == 0 and part is None:
        attempt = _mark_started(ledger, stage, job_id, dist, injob[0])
    elif rank == 0:
        ledger.event("part_started", stage, part=part, job_id=job_id, restarts=restart_count())
    try:
        ctx = stage_context(
            stage,
            cfg,
            Path(run_dir),
            attempt,
            on_hang=(partial(record_hang, ledger, stage, injob[1]),)
            + ((end_local_job,) if local_group else ()),
            dist=dist,
            injob_left=injob[1],
            faults=os.environ.get(FAULT_ENV, ""),
            part=part,
        )
        out = _call_stage(stage, cfg, ctx)
        if cfg.cluster.executor != "debug":  # done: a late Ctrl-C must not cut the recording of it
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except BaseException as e:
        if rank == 0:
            forward_alarms(ledger, stage)
            if part is None:
                record_failure(ledger, stage, cfg, e, injob_left=injob[1])
            else:
                record_part_failure(ledger, stage, cfg, e, part)
        if local_group and not is_preempted(e):
            end_local_job()
        if cfg.cluster.executor == "debug" and _is_interrupted(e):
            return {}  # in-process Ctrl-C, recorded: a stop, not an error for submitit's post-mortem debugger
        raise
    if rank == 0 and part is not None:
        ledger.event("part_completed", stage, part=part)
    elif rank == 0:
        forward_alarms(ledger, stage)
        from pipeline.records.ledger import accounting

        extra = {
            **((ledger.read(stage) or StageRecord(stage)).extra),
            "accounting": accounting(Path(run_dir), stage),
        }
        from engine.context import STAGE_EVENTS

        own = out.pop(STAGE_EVENTS, [])  # the stage's own events (eval: each model's task results)
        ledger.update(stage, status=COMPLETED, ended_at=time.time(), outputs=out, extra=extra)
        for ev in own:
            ledger.event(str(ev["event"]), stage, **{k: v for k, v in ev.items() if k != "event"})
        ledger.event("completed", stage)
    return out


def _interrupt_once(signum: int, frame: Any) -> None:
    """Ctrl-C outside a training loop (start-up, a stage without checkpoints): KeyboardInterrupt once; its
    repeats (the command resends it until the job ends) are ignored while the stop is recorded."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _is_interrupted(e: BaseException) -> bool:
    from engine.runtime.signals import Interrupted

    return isinstance(e, Interrupted)


def end_local_job() -> None:
    """Kill the other ranks of this local job (a hung or failed rank ends the whole job, as SLURM does).

    submitit's local controller waits for every task: a frozen rank (SIGSTOP, a deadlock) would keep the
    job, and the command following it, waiting forever. The siblings are the controller's other children
    carrying this job's id (``SUBMITIT_LOCAL_JOB_ID``); SIGKILL also ends a stopped process. With
    ``cluster.prefork`` those children are the ranks' relays: a signal to one is forwarded to its rank, and
    its rank is killed with it (pipeline.submit.prefork).
    """
    import psutil

    job = os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    if not job:
        return
    me = int(os.environ.get(RELAY_ENV) or os.getpid())  # a forked rank: its relay is the controller's child
    try:
        siblings = psutil.Process(me).parent().children()  # type: ignore[union-attr]
    except (psutil.Error, AttributeError):
        return
    mine = []
    for proc in siblings:
        try:
            if proc.pid != me and proc.environ().get("SUBMITIT_LOCAL_JOB_ID") == job:
                mine.append(proc)
        except psutil.Error:
            continue
    for proc in mine:  # first their stacks into their logs (engine.runtime.signals.STACK_DUMP_SIGNAL)
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGQUIT)
    psutil.wait_procs(mine, timeout=2.0)  # a moment to write them; a stopped process is killed all the same
    for proc in mine:
        try:
            print(f"[launcher] ending rank process {proc.pid} of local job {job}", flush=True)
            proc.kill()
        except psutil.Error:
            continue


def _mark_started(ledger: Ledger, stage: str, job_id: str, dist: DistEnv, injob: int = 0) -> int:
    """Rank 0: the ledger says running; the event records the rendezvous and the code this job imports.
    Returns the stage's attempt number (1 = first start)."""
    rec = ledger.read(stage)
    restarts = restart_count()
    if rec and rec.status == RUNNING and restarts > rec.requeues:  # SLURM restarted it; no rank said why
        ledger.add_failure(stage, classify(Evidence(requeued_silently=True)), "scheduler")
    attempt = (rec.attempts if rec else 0) + 1
    ledger.update(
        stage,
        status=RUNNING,
        started_at=time.time(),
        attempts=attempt,
        requeues=restarts,
        host=socket.gethostname(),
        error=None,
    )
    rendezvous = f"{dist.master_addr}:{dist.master_port}"
    ledger.event(
        "started",
        stage,
        job_id=job_id,
        world_size=dist.world_size,
        restarts=restarts,
        injob=injob,
        master=rendezvous,
        code=str(REPO_ROOT),
    )
    return attempt


def stage_context(
    stage: str,
    cfg: PipelineConfig,
    run_dir: Path,
    attempt: int,
    on_hang: tuple[Callable[[], None], ...] = (),
    dist: DistEnv | None = None,
    faults: str = "",
    part: str | None = None,
    injob_left: int = 0,
) -> StageContext:
    """What the job hands its stage besides the config: paths, plan, and the job's facts (ledger attempt,
    SLURM restarts, whether it may requeue itself, what a hung rank calls before it exits, its place in the
    job, the fault specs to inject)."""
    from engine.context import StageContext

    restarts = restart_count()
    return StageContext(
        run_dir=run_dir,
        stage=stage,
        out_dir=stage_out_dir(run_dir, stage),
        inputs={u: stage_out_dir(run_dir, u) for u in upstream(stage)},
        plan=stage_plan(cfg, stage),
        attempt=attempt,
        restarts=restarts,
        may_requeue=in_slurm_job() and restarts < cfg.cluster.max_requeues,
        injob_left=injob_left,
        on_hang=on_hang,
        dist=dist,
        faults=faults,
        part=part,
    )


def _call_stage(stage: str, cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    """Run the stage's ``main`` (a shared stage: once per data identity, under run.root)."""
    from stages import entry

    main = entry(stage)
    if spec(stage).shared:
        from pipeline.schema.data_identity import link_shared_data, shared_data_prep

        link_shared_data(cfg, ctx.out_dir, stage_hashes(cfg)[stage])
        return shared_data_prep(cfg, ctx.out_dir, lambda: dict(main(cfg, ctx) or {}))
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    return dict(main(cfg, ctx) or {})
