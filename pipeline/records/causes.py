"""Why an attempt failed: a registry of rules from exit codes, signals, scheduler states and log text to a cause.

``classify(Evidence(...))`` tries the rules in order of ``priority`` (lowest first) and answers the first
that matches as a ``Cause`` (name, the rule that decided, a one-line detail). A new rule is one ``@rule``
function; nothing else changes. The causes (``CAUSES``) are what ``pipeline.status`` and the report show
for each failed attempt (``StageRecord.failures``, written by ``Ledger.add_failure``).

Evidence comes from wherever the failure was seen: the job's rank 0 (the exception it caught), a hung rank's
watchdog, the submitter (a local job's exit and every rank's stderr), or the scheduler (sacct's state).
Nothing here imports torch: exceptions are judged by the names of their classes.
"""

from __future__ import annotations

import errno
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CAUSES = (
    "out_of_memory",
    "hang",
    "bad_step",
    "node_failure",
    "preemption",
    "interrupted",
    "time_limit",
    "storage",
    "communication",
    "user_error",
    "configuration",
    "unknown",
)
HANG_EXIT_CODE = 86
"""Exit code of a rank the hang watchdog found hung (engine.runtime.signals; distinct from crashes and signals)."""
LOG_TAIL_CHARS = 20_000
"""How much of the end of each rank's log is read: the failure is at the end."""


@dataclass
class Evidence:
    """What is known about one failed attempt; every field may be empty."""

    exception: str = ""
    """Class name of the exception that ended the attempt (``OutOfMemoryError``)."""
    bases: tuple[str, ...] = ()
    """Class names of its bases (``OSError`` for a ``FileNotFoundError``)."""
    message: str = ""
    errno: int | None = None
    exit_code: int | None = None
    """A process's exit status; negative: killed by that signal (Python's convention)."""
    signal: int | None = None
    slurm_state: str = ""
    """sacct's State of the job (``TIMEOUT``, ``NODE_FAIL``, ``OUT_OF_MEMORY``, ``PREEMPTED``, ...)."""
    log: str = ""
    """The end of the job's logs (every rank's stderr)."""
    requeued_silently: bool = False
    """The scheduler started the job again while the ledger still said running: no rank had a word."""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.exception, *self.bases)

    @property
    def text(self) -> str:
        return f"{self.message}\n{self.log}"

    @property
    def killed_by(self) -> int | None:
        if self.signal is not None:
            return self.signal
        return -self.exit_code if self.exit_code is not None and self.exit_code < 0 else None


@dataclass(frozen=True)
class Cause:
    name: str
    rule: str
    detail: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"cause": self.name, "rule": self.rule, "detail": self.detail}


@dataclass(frozen=True)
class Rule:
    name: str
    cause: str
    priority: int
    match: Callable[[Evidence], str | None]
    """The detail line when the rule applies, else None."""


RULES: list[Rule] = []


def rule(
    cause: str, priority: int
) -> Callable[[Callable[[Evidence], str | None]], Callable[[Evidence], str | None]]:
    """Register ``fn(evidence) -> detail | None`` as a rule deciding ``cause`` (lower priority tried first)."""
    if cause not in CAUSES:
        raise ValueError(f"unknown cause {cause!r}; one of {list(CAUSES)}")

    def register(fn: Callable[[Evidence], str | None]) -> Callable[[Evidence], str | None]:
        RULES.append(Rule(fn.__name__, cause, priority, fn))
        RULES.sort(key=lambda r: r.priority)
        return fn

    return register


def classify(ev: Evidence) -> Cause:
    for r in RULES:
        detail = r.match(ev)
        if detail is not None:
            return Cause(r.cause, r.name, detail[:300])
    return Cause(
        "unknown", "none", _first_line(ev) or "no evidence in exit state or logs (killed from outside?)"
    )


def _first_line(ev: Evidence) -> str:
    if ev.exception and ev.exception not in NOT_A_CAUSE:
        return f"{ev.exception}: {ev.message}".strip().splitlines()[0]
    if ev.killed_by is not None:
        return f"killed by {_signame(ev.killed_by)}"
    if ev.exit_code is not None:
        return f"exit code {ev.exit_code}"
    return ev.slurm_state


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _line(text: str, pattern: str) -> str | None:
    """The last line of ``text`` matching ``pattern`` (case-insensitive), stripped."""
    hits = [ln.strip() for ln in text.splitlines() if re.search(pattern, ln, re.IGNORECASE)]
    return hits[-1] if hits else None


# ---------------------------------------------------------------------------- the rules, most certain first


@rule("time_limit", 10)
def slurm_time_limit(ev: Evidence) -> str | None:
    if ev.slurm_state == "TIMEOUT":
        return "SLURM state TIMEOUT (the job's time limit)"
    return _line(ev.log, r"DUE TO TIME LIMIT")


@rule("node_failure", 10)
def slurm_node_failure(ev: Evidence) -> str | None:
    if ev.slurm_state in ("NODE_FAIL", "BOOT_FAIL"):
        return f"SLURM state {ev.slurm_state}"
    return _line(ev.log, r"DUE TO NODE FAILURE|node failure|Node .* not responding")


@rule("node_failure", 10)
def unhealthy_node(ev: Evidence) -> str | None:
    if "NodesExcluded" in ev.names:  # engine.runtime.health: cluster.health.policy=exclude
        return f"{ev.message} (excluded, job requeued)"
    return None


@rule("preemption", 10)
def preempted(ev: Evidence) -> str | None:
    if ev.slurm_state == "PREEMPTED":
        return "SLURM state PREEMPTED"
    if "Preempted" in ev.names:
        return f"saved and stopped on a signal ({ev.message})"
    return _line(ev.log, r"DUE TO PREEMPTION")


@rule("interrupted", 5)
def interrupted(ev: Evidence) -> str | None:
    """Ctrl-C (SIGINT): the run was stopped on purpose, saved at a step boundary or not (the same command resumes)."""
    if "Interrupted" in ev.names:
        return ev.message or "stopped on Ctrl-C after a checkpoint"
    if "KeyboardInterrupt" in ev.names:
        return (
            "KeyboardInterrupt: Ctrl-C where the stage takes no checkpoint (start-up, or a stage without any)"
        )
    if ev.killed_by == signal.SIGINT:
        return "stopped at once on Ctrl-C (a second press, or no save within cluster.interrupt_grace_s)"
    return _line(ev.log, r"\bInterrupted: Ctrl-C")  # a rank's last line when only its log is read


@rule("hang", 20)
def watchdog_hang(ev: Evidence) -> str | None:
    if ev.exit_code == HANG_EXIT_CODE:
        return f"exit code {HANG_EXIT_CODE} (the hang watchdog)"
    return _line(ev.log + ev.message, r"HangDetected|\[watchdog\] no progress")


@rule("out_of_memory", 20)
def out_of_memory(ev: Evidence) -> str | None:
    if ev.slurm_state == "OUT_OF_MEMORY":
        return "SLURM state OUT_OF_MEMORY (the job's memory limit)"
    if {"OutOfMemoryError", "MemoryError"} & set(ev.names):
        return f"{ev.exception}: {ev.message}".splitlines()[0]
    return _line(
        ev.text,
        r"CUDA out of memory|OutOfMemoryError|oom.kill|Out Of Memory|Cannot allocate memory|can.t allocate memory",
    )


@rule("bad_step", 30)
def bad_steps(ev: Evidence) -> str | None:
    if "BadStepError" in ev.names:
        return f"{ev.exception}: {ev.message}".splitlines()[0]
    return _line(ev.text, r"BadStepError")


STORAGE_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS, errno.ESTALE}


@rule("storage", 30)
def storage(ev: Evidence) -> str | None:
    if ev.errno in STORAGE_ERRNOS:
        return f"{ev.exception} [errno {errno.errorcode.get(ev.errno, ev.errno)}]: {ev.message}".splitlines()[
            0
        ]
    return _line(
        ev.text,
        r"No space left on device|Input/output error|Disk quota exceeded|Read-only file system|Stale file",
    )


@rule("configuration", 40)
def configuration(ev: Evidence) -> str | None:
    if {"ConfigError", "HFConfigError", "ConfigCompositionException"} & set(ev.names):
        return f"{ev.exception}: {ev.message}".splitlines()[0]
    return _line(ev.text, r"ConfigError:|ConfigCompositionException")


COMM_PATTERN = (
    r"NCCL error|ncclInternalError|ncclSystemError|ProcessGroupNCCL|DistBackendError|Connection reset by peer|"
    r"Connection closed by peer|Broken pipe.*(gloo|nccl)|Gloo connectFullMesh failed|RendezvousError|"
    r"timed out .* (rendezvous|store)|DistStoreError|Connection refused.*(29\d\d\d|TCPStore)"
)


@rule("communication", 50)
def communication(ev: Evidence) -> str | None:
    if {"DistBackendError", "DistNetworkError", "DistStoreError", "RendezvousError"} & set(ev.names):
        return f"{ev.exception}: {ev.message}".splitlines()[0]
    return _line(ev.text, COMM_PATTERN)


@rule("node_failure", 60)
def requeued_without_a_word(ev: Evidence) -> str | None:
    if ev.requeued_silently:
        return "the scheduler started the job again while the ledger said running (no rank recorded an end)"
    return None


NOT_A_CAUSE = ("KeyboardInterrupt", "SystemExit", "UncompletedJobError", "FailedJobError", "RunError")
"""Exceptions that only say that a job ended (submitit's, the orchestrator's), never why."""


@rule("user_error", 70)
def exception_in_code(ev: Evidence) -> str | None:
    if ev.exception and ev.exception not in NOT_A_CAUSE:
        return f"{ev.exception}: {ev.message}".strip().splitlines()[0]
    return _line(ev.log, r"^\w+(\.\w+)*(Error|Exception|Fault): ")  # a traceback's last line


@rule("preemption", 80)
def killed_by_stop_signal(ev: Evidence) -> str | None:
    sig = ev.killed_by
    if sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        return f"killed by {_signame(sig)} before it could save (a stop request)"
    return None


def from_exception(e: BaseException) -> Evidence:
    """Evidence of an exception caught in the job (the chain's first cause with an errno counts for storage)."""
    err = next((x.errno for x in _chain(e) if isinstance(x, OSError) and x.errno), None)
    names = tuple(dict.fromkeys(c.__name__ for x in _chain(e) for c in type(x).__mro__ if c is not object))
    return Evidence(exception=type(e).__name__, bases=names[1:], message=str(e), errno=err)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in out and len(out) < 8:
        out.append(x)
        x = x.__cause__ or x.__context__
    return out


def read_logs(folder: Path, pattern: str = "*_log.err") -> str:
    """The end of every rank's log in a submitit folder (``%j_%t_log.err``), rank by rank."""
    parts = []
    for p in sorted(Path(folder).glob(pattern)):
        with p.open("rb") as f:
            f.seek(max(0, p.stat().st_size - LOG_TAIL_CHARS))
            parts.append(f.read().decode(errors="replace"))
    return "\n".join(parts)
