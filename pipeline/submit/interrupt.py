"""Ctrl-C on a command that follows local jobs: keep the work, say so in one line, exit 130.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group: the command, submitit's local job
controller, the ranks (directly, or through their prefork relays). The controller and its tasks start with
SIGINT ignored (``ignoring_sigint``), so the controller never kills the ranks on it and no traceback reaches
the terminal; each rank heeds it again at the job entry point (pipeline.submit.launch.run_stage), and a
training stage treats it as a stop request: it saves at its next step boundary (the preemption path) and
exits (engine.runtime.signals.Interrupted).

The command counts the presses (``Presses``): on the first it stops following the metrics, sends SIGINT to the
job's tasks every ``RESEND_S`` (a rank still starting up heeds a later one; a ``kill -INT`` of the command alone
reaches the ranks so) and waits for the job to end; a second press, or ``cluster.interrupt_grace_s`` seconds without an end, kills the job's
processes at once (``kill_job``: checkpoints are atomic, so the last complete one is what a re-run resumes).
Either way ``Stopped`` carries the one line the command prints before it exits ``EXIT_INTERRUPTED``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

EXIT_INTERRUPTED = 130
"""The command's exit code after Ctrl-C (128 + SIGINT, the shell's convention)."""


class Stopped(Exception):
    """The command stopped on Ctrl-C; the message is the one line it prints."""


@dataclass
class Presses:
    """The SIGINTs the command got while it runs local jobs: counted by the handler, read by the poll loop."""

    count: int = 0
    first_at: float | None = None

    def press(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.first_at is None:
            self.first_at = time.monotonic()

    def past_grace(self, grace_s: float) -> bool:
        """A second press, or ``grace_s`` seconds since the first: stop at once."""
        waited = time.monotonic() - (self.first_at or time.monotonic())
        return self.count > 1 or waited > grace_s


@contextlib.contextmanager
def catching() -> Iterator[Presses]:
    """Count SIGINTs instead of raising KeyboardInterrupt while the block runs (the local executor's loop)."""
    presses = Presses()
    previous = signal.signal(signal.SIGINT, presses.press)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)


class CtrlC(BaseException):
    """Ctrl-C in a companion command that ends itself on it (``ctrl_c_raises``). Not a KeyboardInterrupt: CPython
    marks a KeyboardInterrupt that passes through an ``exec`` of source text (a dataclass being created, as
    lazy imports do) as unhandled even when caught later, and then ends the process by SIGINT at exit: exit
    status -2 instead of the command's 130."""


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """While the block runs, SIGINT raises ``CtrlC``."""

    def raise_ctrl_c(signum: int, frame: FrameType | None) -> None:
        raise CtrlC

    previous = signal.signal(signal.SIGINT, raise_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def ignoring_sigint() -> Iterator[None]:
    """Processes started in the block inherit SIGINT ignored (an exec keeps SIG_IGN, and Python then installs no
    KeyboardInterrupt handler): submitit's controller and its tasks; the ranks opt back in themselves."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


RESEND_S = 1.0
"""After the first press, how often the command sends SIGINT to the job's tasks again until the job ends: a
rank still starting up ignores it (``ignoring_sigint``) and heeds the next one; repeats are harmless."""


def follow(job: Any, poll: Callable[[], None], presses: Presses, grace_s: float, poll_s: float) -> bool:
    """Wait for a local ``job`` to end, calling ``poll`` (its metrics) until the first press, then resending
    SIGINT to its tasks. A second press or ``grace_s`` after the first kills the job's processes. Returns True
    when it killed them."""
    sent = -RESEND_S
    while not job.done():
        if not presses.count:
            poll()
        elif presses.past_grace(grace_s):
            kill_job(int(job.job_id))
            return True
        elif time.monotonic() - sent >= RESEND_S:
            send_to_tasks(int(job.job_id), signal.SIGINT)
            sent = time.monotonic()
        time.sleep(poll_s)
    return False


def send_to_tasks(controller: int, sig: int) -> None:
    """``sig`` to a local job's tasks: the ranks, or their prefork relays (which forward it to their ranks).
    Only those: a rank's own helpers (data workers, checkpoint writers) take no Ctrl-C of their own."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(controller).children():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)


def kill_job(controller: int) -> None:
    """SIGKILL a local job: its controller and every process under it (the ranks, or their prefork relays:
    the prefork server kills a rank whose relay is gone, pipeline.submit.prefork). Not waited for here: the
    controller is reaped by its job's poll, the others are no children of this process."""
    import psutil

    try:
        root = psutil.Process(controller)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def saved_line(label: str, step: int | None) -> str:
    """The line after the stage ended by itself on the first press."""
    if step is None:
        return f"[{label}] stopped on Ctrl-C (nothing new to save); run the same command again to continue"
    return f"[{label}] stopped on Ctrl-C: checkpoint saved at step {step}; run the same command again to continue"


def killed_line(label: str, presses: Presses, grace_s: float) -> str:
    """The line after the command ended the stage's processes at once."""
    why = "a second Ctrl-C" if presses.count > 1 else f"no checkpoint within {grace_s:g} s of Ctrl-C"
    return (
        f"[{label}] stopped at once on {why}: run the same command again to continue from its last "
        "complete checkpoint"
    )
