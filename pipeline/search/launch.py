"""``python -m pipeline -m search=optuna ...``: validate the search, probe its box, start the controller detached.

Before anything is submitted: the base config and the search section are validated, the sampler is built
(grid needs choice/range keys), and every corner of the box (pipeline.search.space.Space.corners) is composed,
validated and pre-flighted as a trial would be, so a space that can produce an invalid trial, or names a key
that does not exist, is a config error naming the key and the corner. The command then returns with the sweep
directory; the controller runs on detached (its log: ``<sweep>/.search/controller.log``): with the local and
debug executors a background process in its own session on this host, with ``cluster.executor=slurm`` a
one-CPU SLURM job (pipeline.submit.slurm.submit_service) that SLURM requeues on node failure and preemption and
that requeues itself at its time limit; each restart resumes the study from its journal.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from pipeline.cli.compose import load
from pipeline.records.files import atomic_write_text
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.search import registry, trials
from pipeline.search import study as studies
from pipeline.search.space import Space, parse


def selected(overrides: list[str]) -> bool:
    """Whether a ``-m`` command line is a search (search=optuna or search.enabled=true, here or in a preset)."""
    try:
        space = parse(overrides)
    except ConfigError:  # no searched key: a search of nothing is refused by start()
        base = [o for o in overrides if "," not in o and "(" not in o]
        return bool(load(base, inputs=False).search.enabled) if base else False
    except Exception:  # not Hydra's grammar: the grid's path reports it in the usual shape
        return False
    return bool(load([*space.base, *space.search], inputs=False).search.enabled)


def probe(space: Space) -> int:
    """Validate every corner of the box as a trial; returns how many were checked."""
    corners = space.corners()
    for i, point in enumerate(corners):
        try:
            load(space.trial_overrides(point))
        except ConfigError as e:
            shown = " ".join(f"{k}={v}" for k, v in point.items())
            raise ConfigError(
                f"{e} [search space corner {i + 1} of {len(corners)}: {shown}; the box can give invalid "
                "trials: narrow it; nothing submitted]"
            ) from None
    return len(corners)


def start(overrides: list[str], out: TextIO) -> int:
    """Check the search, record it under run.root and start (or find running) its controller."""
    space = parse(overrides)
    cfg = load([*space.base, *space.search])
    registry.check_objective(cfg)
    registry.SAMPLERS[cfg.search.sampler](cfg.search, space)  # a grid over an interval: config error now
    checked = probe(space)
    sweep = Path(cfg.run.root).resolve()
    spec = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "run.root"] + [f"run.root={sweep}"]
    studies.write_spec(sweep, spec)
    print(f"search: {len(space.dims)} keys, {checked} corners of the box valid", file=out)
    if controller_alive(sweep):
        print(f"search: its controller already runs; sweep directory: {sweep}", file=out)
        return 0
    print(f"search: controller started ({SPAWNERS[cfg.cluster.executor](sweep, cfg)})", file=out)
    print(f"sweep directory: {sweep}", file=out)
    print(f"  python -m pipeline.status {sweep}    python -m pipeline.cancel {sweep}", file=out)
    return 0


def controller_alive(sweep: Path) -> bool:
    """Whether the sweep's controller runs (or, as a SLURM job, is queued to run)."""
    from pipeline.slurm.queries import slurm_job_alive

    job = controller_job(sweep)
    if job is not None:
        return slurm_job_alive(job)
    p = studies.search_dir(sweep) / "controller.json"
    if not p.is_file():
        return False
    c = json.loads(p.read_text())
    return trials.alive(c.get("pid"), c.get("start"))


def controller_job(sweep: Path) -> str | None:
    """The SLURM job id of the sweep's controller (None: it runs as a process on the submitting host)."""
    p = studies.search_dir(sweep) / "controller_job.json"
    return str(json.loads(p.read_text())["job_id"]) if p.is_file() else None


def _spawn_process(sweep: Path, cfg: PipelineConfig) -> str:
    """The controller as a background process in its own session (it outlives this command)."""
    (studies.search_dir(sweep) / "controller_job.json").unlink(missing_ok=True)
    log = studies.search_dir(sweep) / "controller.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.search", str(sweep)],
            cwd=trials.PROJECT,  # the trials' working directory: its prefork server forks only for that one
            env={**os.environ, "PYTHONPATH": _pythonpath()},
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return f"process {proc.pid}"


def _submit_job(sweep: Path, cfg: PipelineConfig) -> str:
    """The controller as a one-CPU SLURM job (pipeline.submit.slurm.submit_service)."""
    from pipeline.submit.slurm import check_slurm, submit_service

    check_slurm()
    setup = [f"export PYTHONPATH={shlex.quote(_pythonpath())}"]
    folder = studies.search_dir(sweep) / "controller"
    job = submit_service(cfg, folder, f"{cfg.run.name}-search", setup, ControllerJob(), str(sweep))
    atomic_write_text(studies.search_dir(sweep) / "controller_job.json", json.dumps({"job_id": job}))
    return f"SLURM job {job}"


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(trials.PROJECT), os.environ.get("PYTHONPATH", "")) if p)


class ControllerJob:
    """The controller as a SLURM job's function; submitit requeues it at its time limit (``checkpoint``: the
    same call again, since the study's journal and the trial files hold all its state)."""

    def __call__(self, sweep: str) -> int:
        from pipeline.search.controller import run

        with open(studies.search_dir(Path(sweep)) / "controller.log", "a") as out:
            return run(Path(sweep), out)

    def checkpoint(self, sweep: str) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, sweep)


SPAWNERS = {"local": _spawn_process, "debug": _spawn_process, "slurm": _submit_job}
"""How the controller is started, by ``cluster.executor``; each returns what it started, for the user."""
