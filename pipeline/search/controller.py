"""The search controller: ask Optuna, submit, poll, prune, tell; ``max_concurrent`` trials always in flight.

No batch barrier: each poll first settles every trial that ended (completed, failed) or that the pruner stops,
then refills each free slot at once. Killed at any moment, a new controller (the same command again) opens the
same study, adopts the trials in flight (their files name run directory and process: pipeline.search.trials),
tells the ones that ended meanwhile, submits a trial that was asked but never started, and goes on: no trial
is lost or submitted twice.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pipeline.cli.compose import load
from pipeline.records.files import atomic_write_text
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.identity import run_dir_for
from pipeline.search import registry, trials
from pipeline.search import study as studies
from pipeline.search.space import Space
from pipeline.search.trials import COMPLETE, CUT_OFF, FAILED, RUNNING, TrialFile
from pipeline.slurm.queries import alive_jobs


@dataclass
class Controller:
    """One controller's view: the study, the space, and the trials in flight (number -> file, Optuna trial)."""

    sweep: Path
    cfg: PipelineConfig
    space: Space
    study: Any
    out: TextIO
    inflight: dict[int, TrialFile] = field(default_factory=dict)
    handles: dict[int, Any] = field(default_factory=dict)
    reported: dict[int, set[int]] = field(default_factory=dict)
    prefork_socket: str | None = None
    """The controller's prefork server, shared by its local trials (each skips the imports it would pay)."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    """The environment trial commands start from: the controller's as its prefork server started in it."""
    thread_caps: list[str] = field(default_factory=list)
    """Overrides added to every trial's command line: local trials' threads capped (``thread_caps``)."""
    told: bool = False
    """The study heard of a trial's end since the summary was last written."""
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set on SIGTERM (cancel, preemption, a requeue): start nothing more; the next controller resumes."""

    def say(self, text: str) -> None:
        print(f"[search {time.strftime('%H:%M:%S')}] {text}", file=self.out, flush=True)

    # ------------------------------------------------------------------ resume

    def adopt(self) -> None:
        """Trials the study has as running: adopted if started, submitted if asked but never started."""
        import optuna
        from optuna.trial import TrialState

        for ft in self.study.get_trials(deepcopy=False):
            tf = trials.load(self.sweep, ft.number)
            if ft.state != TrialState.RUNNING:
                if tf is not None and tf.ended is None:  # told, then killed before its file said so
                    tf.ended = ft.state.name.lower()
                    trials.save(self.sweep, tf)
                continue
            handle = optuna.trial.Trial(self.study, ft._trial_id)
            self.handles[ft.number] = handle
            self.reported[ft.number] = set(ft.intermediate_values)
            if tf is not None and tf.ended == "pruned":  # stopped, then killed before the study heard it
                self._tell_pruned(tf)
            elif tf is None or tf.pid is None:
                self.say(f"trial {ft.number}: asked before the controller stopped, never started: submitting")
                self._start(handle, ft.params)
            else:
                self.say(f"trial {ft.number}: adopted ({tf.run_dir})")
                self.inflight[ft.number] = tf

    # ------------------------------------------------------------------ one poll

    def poll(self) -> None:
        """Settle every trial in flight: report new rung values (maybe prune), tell those that ended."""
        ids = [j for t in self.inflight.values() if t.executor == "slurm" for j in trials.job_ids(t)]
        alive = alive_jobs(ids) if ids else set()  # one query for every trial together; None: query failed
        if alive is None:
            self.say("SLURM did not answer this poll: trials' jobs are asked again at the next")
        for number, tf in list(self.inflight.items()):
            st, why = trials.state(tf, alive)
            if st == CUT_OFF and not self.stopping.is_set():
                self.say(f"trial {number}: its command ended mid-submission: starting it again")
                trials.submit(self.sweep, tf, self.prefork_socket, self.env)
            elif st == RUNNING:
                self._maybe_prune(tf)
            elif st == COMPLETE:
                self._maybe_prune(tf, prune=False)  # its last rungs too: later trials are compared with them
                value = registry.objective_value(self.cfg.search.objective, tf.path_dir)
                if value is None:
                    self._tell_failed(tf, f"no {self.cfg.search.objective} in {tf.run_dir}")
                else:
                    self._end(tf, "complete", values=value)
                    self.say(f"trial {number}: complete, {self.cfg.search.objective}={value:.6g}")
            elif st == FAILED:
                self._tell_failed(tf, why)

    def _maybe_prune(self, tf: TrialFile, prune: bool = True) -> None:
        """Report the trial's rung values not reported yet and, with ``prune``, stop it when the pruner says."""
        handle = self.handles[tf.number]
        seen = self.reported.setdefault(tf.number, set())
        stage = self.cfg.search.prune_stage
        for step, value in registry.prune_points(
            self.cfg.search, tf.path_dir / "stages" / stage / "metrics.jsonl"
        ):
            if step in seen:
                continue
            seen.add(step)
            handle.report(value, step)
            if prune and handle.should_prune():
                tf.pruned = {"stage": stage, "step": step, "value": value}
                tf.ended = "pruned"
                trials.save(self.sweep, tf)  # first: a controller killed now tells the study on resume
                trials.stop(tf, "pruned", stage, step=step, value=value, by="search pruner")
                self._tell_pruned(tf)
                return

    def _tell_pruned(self, tf: TrialFile) -> None:
        from optuna.trial import TrialState

        h = self.handles[tf.number]
        h.set_user_attr("pruned", tf.pruned)
        self._end(tf, "pruned", state=TrialState.PRUNED)
        self.say(
            f"trial {tf.number}: pruned at step {tf.pruned.get('step')} (valid loss {tf.pruned.get('value')})"
        )

    def _tell_failed(self, tf: TrialFile, why: str) -> None:
        from optuna.trial import TrialState

        self.handles[tf.number].set_user_attr("error", why)
        self._end(tf, "failed", state=TrialState.FAIL)
        self.say(f"trial {tf.number}: failed: {why}")

    def _end(self, tf: TrialFile, ended: str, **tell: Any) -> None:
        h = self.handles[tf.number]
        if tf.submitted_at is not None:
            h.set_user_attr("wall_s", round(time.time() - tf.submitted_at, 3))
        self.study.tell(h, **tell)
        tf.ended = ended
        trials.save(self.sweep, tf)
        self.inflight.pop(tf.number, None)
        self.told = True

    def write_summary(self) -> None:
        """study.json and best.yaml, once per poll in which trials ended, after the free slots are refilled
        (fANOVA's importances take a while: no slot waits for them)."""
        if self.told:
            studies.write_summary(self.sweep, self.study, self.cfg, self.space)
            studies.write_best(self.sweep, self.study, self.space)
            self.told = False

    # ------------------------------------------------------------------ refill

    def refill(self) -> None:
        """Ask for and submit trials until max_concurrent are in flight or the study has n_trials."""
        sc = self.cfg.search
        while (
            not self.stopping.is_set()
            and len(self.inflight) < sc.max_concurrent
            and len(self.study.get_trials(deepcopy=False)) < sc.n_trials
        ):
            handle = self.study.ask(fixed_distributions=self.space.dims)
            self.handles[handle.number] = handle
            self.reported[handle.number] = set()
            self._start(handle, handle.params)

    def _start(self, handle: Any, params: dict[str, Any]) -> None:
        """Validate a sampled trial (the project's whole config check and pre-flight), then submit it."""
        from optuna.trial import TrialState

        overrides = [*self.space.trial_overrides(params), *self.thread_caps]
        try:
            cfg = load(overrides)
        except ConfigError as e:
            handle.set_user_attr("error", f"invalid: {e}")
            self.study.tell(handle, state=TrialState.FAIL)
            self.say(f"trial {handle.number}: not submitted, config error: {e}")
            return
        run_dir = run_dir_for(cfg)
        tf = TrialFile(handle.number, overrides, str(run_dir), list(cfg.run.stages), cfg.cluster.executor)
        handle.set_user_attr("run_dir", str(run_dir))
        handle.set_user_attr("overrides", overrides)
        trials.save(self.sweep, tf)
        trials.submit(self.sweep, tf, self.prefork_socket, self.env)
        handle.set_user_attr("pid", tf.pid)
        self.inflight[handle.number] = tf
        self.say(f"trial {handle.number}: submitted {' '.join(f'{k}={v}' for k, v in params.items())}")

    def finished(self) -> bool:
        return not self.inflight and len(self.study.get_trials(deepcopy=False)) >= self.cfg.search.n_trials


def run(sweep: Path, out: TextIO) -> int:
    """The controller's life: one per sweep (a lock), adopt, then poll and refill until the study is done."""
    sdir = studies.search_dir(sweep)
    lock = open(sdir / "controller.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"another controller runs this search ({sweep})", file=out)
        return 0
    atomic_write_text(
        sdir / "controller.json",
        json.dumps(
            {"pid": os.getpid(), "start": trials.process_start(os.getpid()), "started_at": time.time()}
        ),
    )
    space = studies.space_of(sweep)
    cfg = load([*space.base, *space.search])
    env = dict(os.environ)  # before any import the study makes later can change it (trials.submit)
    server = _shared_prefork(sweep, cfg)
    socket = str(server.socket_path) if server else None
    caps = thread_caps(cfg, space, len(os.sched_getaffinity(0)))
    study = studies.open_study(sweep, cfg, space)
    c = Controller(sweep, cfg, space, study, out, prefork_socket=socket, env=env, thread_caps=caps)
    if caps:
        c.say(f"local trials: {' '.join(caps)} ({cfg.search.max_concurrent} trials at once on this machine)")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: c.stopping.set())
    try:
        c.adopt()
        while not c.stopping.is_set():
            c.poll()
            c.refill()
            c.write_summary()
            if c.finished():
                break
            c.stopping.wait(cfg.search.poll_s)
    finally:
        if server is not None:
            server.release()  # trials still running keep their ranks; it ends after them
    if c.stopping.is_set():
        c.write_summary()
        c.say("stopping on SIGTERM: nothing more started; the next start of the controller resumes the study")
        return 0
    studies.write_summary(sweep, c.study, cfg, space)
    best = studies.write_best(sweep, c.study, space)
    c.say(f"study done: {len(c.study.get_trials(deepcopy=False))} trials; best: {best or 'none completed'}")
    _report(sweep, c)
    return 0


def thread_caps(cfg: PipelineConfig, space: Space, cores: int) -> list[str]:
    """Local trials share this machine: each selected stage's ``threads`` at most cores // max_concurrent
    (torch's idle threads spin: oversubscribed, they burn CPU without speed), except where the command line
    sets it. SLURM trials: none (each job has the CPUs it asked for)."""
    if cfg.cluster.executor != "local":
        return []
    cap = max(1, cores // cfg.search.max_concurrent)
    given = {o.lstrip("+~").split("=", 1)[0] for o in [*space.base, *space.search, *space.dims]}
    return [
        f"{s}.threads={cap}"
        for s in cfg.run.stages
        if f"{s}.threads" not in given and getattr(cfg, s).threads > cap
    ]


def _shared_prefork(sweep: Path, cfg: PipelineConfig) -> Any:
    """Local trials with prefork: one server for all of them (pipeline.submit.prefork), else None."""
    if cfg.cluster.executor != "local" or not cfg.cluster.prefork:
        return None
    from pipeline.submit import prefork

    return prefork.start(studies.search_dir(sweep) / "prefork.log")


def _report(sweep: Path, c: Controller) -> None:
    from pipeline.reporting.html import write_report

    try:
        c.say(f"report: {write_report(sweep)}")
    except Exception as e:  # the study's result does not depend on its report
        c.say(f"report: not written ({type(e).__name__}: {e})")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run(Path(args[0]).resolve(), sys.stdout)
