"""Deterministic fault injection for tests and users' own drills.

Set ``PIPELINE_FAULT`` (read once by the job entry point, pipeline.submit.launch, and handed down as
``StageContext.faults``) to one or more comma-separated specs ``<action>@<phase>:<step>[/rank=<r>]``:

- action: ``kill`` (SIGKILL this process), ``hang`` (stop making progress forever), ``hold`` (stop making
  progress until a stop request arrives, then go on: a run held at a known step for a signal), ``raise`` (an exception),
  ``nan`` (the step's loss becomes NaN), ``term`` / ``usr1`` / ``usr2`` (send that signal to this process).
- phase: ``step`` (before optimizer step <step>, 1-based), ``ckpt_write`` (inside the checkpoint save of
  iteration <step>, after files are written and before the commit), ``ckpt_commit`` (after the commit,
  before the ``latest`` pointer moves).
- rank: only that global rank (default: every rank).

Examples: ``kill@step:3``, ``hang@step:5/rank=1``, ``kill@ckpt_write:4``, ``usr1@step:6/rank=0``.

Each spec fires once per stage directory: a marker file under ``<out_dir>/.faults`` remembers it, so the
resumed run passes the same step. Without ``PIPELINE_FAULT`` nothing here does anything.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "PIPELINE_FAULT"
ACTIONS = ("kill", "hang", "hold", "raise", "nan", "term", "usr1", "usr2")
PHASES = ("step", "ckpt_write", "ckpt_commit")
SIGNALS = {"term": signal.SIGTERM, "usr1": signal.SIGUSR1, "usr2": signal.SIGUSR2}


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` action."""


@dataclass(frozen=True)
class FaultSpec:
    action: str
    phase: str
    step: int
    rank: int | None = None

    @property
    def key(self) -> str:
        return f"{self.action}@{self.phase}:{self.step}" + (
            f"/rank={self.rank}" if self.rank is not None else ""
        )


def parse(text: str) -> list[FaultSpec]:
    """Parse ``PIPELINE_FAULT``; a malformed spec raises ValueError naming the variable and the fix."""
    specs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            head, _, rank_part = part.partition("/")
            action, _, where = head.partition("@")
            phase, _, step = where.partition(":")
            rank = int(rank_part.removeprefix("rank=")) if rank_part else None
            spec = FaultSpec(action, phase, int(step), rank)
        except ValueError:
            raise ValueError(
                f"{ENV}={text!r}: cannot parse {part!r}; expected <action>@<phase>:<step>[/rank=<r>]"
            ) from None
        if spec.action not in ACTIONS or spec.phase not in PHASES:
            raise ValueError(
                f"{ENV}={text!r}: action must be one of {list(ACTIONS)} and phase one of {list(PHASES)}"
            )
        specs.append(spec)
    return specs


class FaultInjector:
    """Fires the configured faults at their phase and step, once each per stage directory."""

    def __init__(
        self, state_dir: Path, rank: int, text: str = "", released: Callable[[], bool] = lambda: False
    ) -> None:
        self.specs = parse(text)
        self.state_dir = Path(state_dir) / ".faults"
        self.rank = rank
        self.released = released  # ends a ``hold`` (the stage's stop flag: a signal arrived)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def check(self, phase: str, step: int) -> str | None:
        """Fire a matching fault (kill/hang/raise/signal never return normally); returns 'nan' for a NaN fault."""
        for spec in self.specs:
            if spec.phase != phase or spec.step != step or (spec.rank is not None and spec.rank != self.rank):
                continue
            if not self._claim(spec):
                continue
            return self._fire(spec)
        return None

    def _claim(self, spec: FaultSpec) -> bool:
        marker = self.state_dir / f"{spec.key.replace('/', '_')}.rank{self.rank}"
        if marker.exists():
            return False
        self.state_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{time.time()}\n")
        return True

    def _fire(self, spec: FaultSpec) -> str | None:
        print(f"[fault] injecting {spec.key} on rank {self.rank}", flush=True)
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.action == "hang":
            while True:
                time.sleep(3600)
        if spec.action == "hold":
            while not self.released():
                time.sleep(0.05)
            return None
        if spec.action == "raise":
            raise InjectedFault(f"injected by {ENV}: {spec.key}")
        if spec.action in SIGNALS:
            os.kill(os.getpid(), SIGNALS[spec.action])
            return None
        return "nan"
