"""Signals have one owner: handlers only set a flag; the training loop saves at a step boundary.

``StopFlag.install()`` replaces submitit's USR2 handler (which checkpoints inside the handler on rank 0
only and ignores SIGTERM) for SIGUSR1, SIGUSR2, SIGTERM and SIGINT (Ctrl-C: the same save, then the run stops
instead of being requeued: ``Interrupted``). The loop all-reduces the flag every step
(``distributed.any_rank``) so every rank stops at the same step, saves collectively, and rank 0 asks
SLURM to requeue the job (``requeue_self``).

``Watchdog`` is the hang detector: a daemon thread that, when the loop reports no progress for
``timeout_s``, dumps every thread's stack to the log, asks SLURM for a requeue, and exits with
``HANG_EXIT_CODE``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from pipeline.records.causes import HANG_EXIT_CODE  # noqa: F401  (exit code of a rank the watchdog found hung)
from pipeline.slurm.job_env import requeue_self

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """Raised by the loop after it saved on a stop signal; the job runner records it and requeues."""


class Interrupted(Preempted):
    """Raised by the loop after it saved on SIGINT (Ctrl-C): the stage stops there, never requeued; the same
    command resumes it. Its only argument is the step saved (so it pickles back as it was)."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step

    def __str__(self) -> str:
        return f"Ctrl-C (SIGINT) at step {self.step}; checkpoint saved"


def stopped(signum: int | None, step: int) -> Preempted:
    """What the loop raises once it saved at ``step`` on ``signum``: Ctrl-C stops the run, the others requeue."""
    if signum == signal.SIGINT:
        return Interrupted(step)
    return Preempted(f"signal {signum} at step {step}; checkpoint saved")


class StopFlag:
    """Set by SIGUSR1/SIGUSR2/SIGTERM/SIGINT; read by the loop at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopFlag:
        if threading.current_thread() is not threading.main_thread():
            return (
                self  # signal handlers can only be set from the main thread (e.g. cluster=debug in a thread)
            )
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            if sig == signal.SIGINT and self.signum == sig:  # Ctrl-C heeded: its repeats (the command resends
                prev = signal.SIG_IGN  # it until the job ends) must not cut the recording of the stop
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum != signal.SIGINT:  # Ctrl-C, once seen, decides: stop, not requeue
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


STACK_DUMP_SIGNAL = signal.SIGQUIT
"""A training rank with a watchdog dumps every thread's stack to its log on this signal and goes on (the
local launcher sends it to a job's other ranks before it ends them, so a hung sibling's stack is kept)."""


class Watchdog:
    """Exits the process with HANG_EXIT_CODE when ``beat()`` is not called for ``timeout_s`` seconds.

    Armed by the first ``beat()`` (the training loop's first step), so a slow start-up is not a hang.
    ``may_requeue``: ask SLURM to requeue the job before the exit (StageContext.may_requeue); ``on_hang``:
    called just before the exit (StageContext.on_hang: the local launcher ends the job's other ranks).
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        may_requeue: bool = False,
        on_hang: tuple[Callable[[], None], ...] = (),
        poll_s: float = 1.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.may_requeue = may_requeue
        self.on_hang = on_hang
        self.poll_s = min(poll_s, max(timeout_s / 4, 0.05))
        self._last: float | None = (
            None  # armed by the first beat: start-up (imports, model build) is not a hang
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
            self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._last is None:
                continue
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        print(
            f"[watchdog] no progress for {idle:.0f} s (limit {self.timeout_s:.0f} s): stacks follow",
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        if self.may_requeue:
            requeue_self(f"hang detected after {idle:.0f} s without progress")
        print(f"[watchdog] HangDetected: exiting with code {HANG_EXIT_CODE}", file=sys.stderr, flush=True)
        for hook in self.on_hang:
            try:
                hook()
            except Exception as e:  # the exit below must happen whatever a hook does
                print(f"[watchdog] hang hook failed: {e}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)
