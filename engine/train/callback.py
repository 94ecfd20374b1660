"""The training loop's callback seam: the loop calls hooks, one module per sink implements them.

``engine.train.trainer.Trainer`` calls, on rank 0 and on every other rank alike (sinks decide; the shipped
ones act on rank 0 only):

- ``on_train_start(view)`` once ``fit`` starts (after a resume: ``view.step`` is the resumed step);
- ``on_step_end(view)`` after every optimizer step; ``view.logged`` says whether this step wrote a ``train``
  line to metrics.jsonl (then ``view.metrics`` is that line, else the step's raw metrics);
- ``on_eval(view)`` after a validation pass (``view.metrics``: the ``valid`` line);
- ``on_save(view)`` after a checkpoint save (``view.metrics``: the ``checkpoint`` line);
- ``on_stop(view)`` when a stop request (signal) ends the loop early, after its checkpoint;
- ``on_train_end(view)`` when ``fit`` returns (``view.metrics``: the summary); ``close()`` always, last;
- ``on_alarm(view)`` when an alarm fires (``view.metrics``: the ``alarm`` line; may come from the stall thread);
- ``on_straggler(view)`` after a straggler check (``view.metrics``: the ``straggler`` line, scores per node).

Callbacks get a read-only view (``StepView``: step, metrics mapping, stage info), never the trainer.
metrics.jsonl stays the source of truth; sinks mirror it. ``Callbacks`` runs a list of them and disables
any one that raises (logged once), so a failing sink never stops training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageInfo:
    """What a callback may know about the stage (set once by engine.run)."""

    name: str
    """Stage name (pretrain, sft, rlhf)."""
    out_dir: Path
    """The stage's directory (run_dir/stages/<name>)."""
    run_dir: Path | None = None
    iters: int = 0
    rank: int = 0
    world_size: int = 1
    config: Mapping[str, Any] = field(default_factory=dict)
    """The resolved pipeline config (plain data) for sinks that record it."""
    attempt: int = 0
    """The stage's attempt number on rank 0 (the ledger's count; 1 = first start; 0 elsewhere)."""

    @property
    def rank0(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class StepView:
    """A read-only snapshot handed to callbacks."""

    stage: StageInfo
    step: int
    metrics: Mapping[str, Any]
    logged: bool = False


def view(
    stage: StageInfo, step: int, metrics: Mapping[str, Any] | None = None, logged: bool = False
) -> StepView:
    return StepView(stage, step, MappingProxyType(dict(metrics or {})), logged)


class Callback:
    """Base class: override the hooks you need; every hook is a no-op here."""

    def on_train_start(self, view: StepView) -> None: ...

    def on_step_end(self, view: StepView) -> None: ...

    def on_eval(self, view: StepView) -> None: ...

    def on_save(self, view: StepView) -> None: ...

    def on_stop(self, view: StepView) -> None: ...

    def on_train_end(self, view: StepView) -> None: ...

    def on_alarm(self, view: StepView) -> None: ...

    def on_straggler(self, view: StepView) -> None: ...

    def close(self) -> None: ...


Hook = Literal[
    "on_train_start",
    "on_step_end",
    "on_eval",
    "on_save",
    "on_stop",
    "on_train_end",
    "on_alarm",
    "on_straggler",
    "close",
]
"""The names of ``Callback``'s methods: ``Callbacks.emit`` calls one by name on every callback."""
HOOKS: tuple[Hook, ...] = get_args(Hook)


class Callbacks:
    """Calls each hook on every enabled callback; a callback that raises is logged and disabled."""

    def __init__(self, callbacks: Iterable[Callback] = (), stage: StageInfo | None = None) -> None:
        self.callbacks = list(callbacks)
        self.stage = stage or StageInfo("stage", Path("."))
        self.disabled: dict[str, str] = {}
        """Class name -> the error that disabled it."""

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def emit(
        self, hook: Hook, step: int, metrics: Mapping[str, Any] | None = None, logged: bool = False
    ) -> None:
        if not self.callbacks:
            return
        v = view(self.stage, step, metrics, logged)
        for cb in list(self.callbacks):
            self._call(cb, hook, v)

    def close(self) -> None:
        for cb in list(self.callbacks):
            self._call(cb, "close", None)
        self.callbacks = []

    def _call(self, cb: Callback, hook: Hook, v: StepView | None) -> None:
        try:
            getattr(cb, hook)(*(() if v is None else (v,)))
        except Exception as e:  # a sink never stops training
            name = type(cb).__name__
            self.disabled[name] = f"{type(e).__name__}: {e}"
            log.error(
                "callback %s failed in %s (%s: %s); disabled for the rest of the stage",
                name,
                hook,
                type(e).__name__,
                e,
            )
            self.callbacks.remove(cb)
            if hook != "close":
                try:
                    cb.close()
                except Exception:
                    pass
