"""The forked async writer: megatron's AsyncCallsQueue with a results queue that survives SLURM's signals.

Every process forked for writing (the manager, megatron's async and per-bucket writers) ignores the stop
signals the training process owns and dies with its parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.managers import SyncManager
from typing import Any


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


_PR_SET_PDEATHSIG = 1
_FORK_STATE = {"parent": 0, "main_thread": False}


def _die_with_parent() -> None:
    """In a forked child: be SIGKILLed when the parent dies (Linux prctl), or exit now if it already did.

    The death signal fires when the *thread* that forked ends, so it is set only for forks made by the
    main thread (megatron's writers and our manager are), whose end is the process's end.
    """
    if not _FORK_STATE["main_thread"]:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing ties the helper to us
        return
    if os.getppid() != _FORK_STATE["parent"]:
        os._exit(1)  # the parent died between the fork and the prctl


def _before_fork() -> None:
    import threading

    _FORK_STATE.update(parent=os.getpid(), main_thread=threading.current_thread() is threading.main_thread())


def _tie_forks_to_this_process() -> None:
    """Every process forked from now on (the manager, megatron's async and per-bucket writers, their own
    forks) dies with its parent: a SIGKILLed rank or a watchdog exit leaves no writer behind."""
    global _FORKS_TIED
    if not _FORKS_TIED:
        os.register_at_fork(before=_before_fork, after_in_child=_die_with_parent)
        _FORKS_TIED = True


_FORKS_TIED = False


def _writer_helper_init() -> None:
    _ignore_stop_signals()
    _die_with_parent()


def signal_safe_writer_queue() -> None:
    """Give dist_checkpointing's writer a results queue whose manager survives SLURM's warning signals.

    megatron 0.16-0.19 lazily starts a *spawned* multiprocessing manager for the writers' results (a
    fresh Python that imports torch: ~1.4 s at the first save, and a resource tracker besides). SLURM
    signals every process of a job step (``--signal``, scancel, preemption), the spawned manager dies of
    the default action, and the save that the signal asked for fails with BrokenPipeError. Ours is
    *forked* once per process (milliseconds, memory shared copy-on-write, no resource tracker), ignores
    SIGUSR1/SIGUSR2/TERM (the training process owns them), and dies with the training process
    (PR_SET_PDEATHSIG), as does every writer forked after it.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _tie_forks_to_this_process()
    if getattr(filesystem_async, "_results_queue", "missing") is not None:
        return  # already created (by us), or a megatron version without this global
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=_writer_helper_init)
    filesystem_async._results_queue = manager.Queue()
    global _MANAGER
    _MANAGER = manager


_MANAGER: Any = None
"""The manager behind dist_checkpointing's results queue (kept alive for the process's lifetime)."""

_QUEUE: Any = None
"""megatron's AsyncCallsQueue, created by the first async save."""


def async_queue() -> Any:
    global _QUEUE
    if _QUEUE is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _QUEUE = AsyncCallsQueue()
    return _QUEUE


def finalize_async(blocking: bool = False) -> None:
    """Commit the async saves whose writes have finished on every rank; collective (every rank calls it).

    ``blocking=True`` waits for the writes. A no-op when no async save was made.
    """
    if _QUEUE is not None and _QUEUE.get_num_unfinalized_calls():
        _QUEUE.maybe_finalize_async_calls(blocking=blocking)


def pending_async() -> int:
    """Async saves made by this process and not yet committed (finalized)."""
    return int(_QUEUE.get_num_unfinalized_calls()) if _QUEUE is not None else 0
