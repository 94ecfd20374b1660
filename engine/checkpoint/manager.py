"""The checkpoint manager of a training stage: resume, init_from, periodic saves and their failures.

``Checkpointer`` holds the stage's checkpoint settings (fixed when it is built) and the little state of
its saves (the last path, stall times, failures in a row); the trainer calls it and never sets it up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from engine.checkpoint import writer
from engine.checkpoint.errors import WRITE_FAILURES, CheckpointError
from engine.checkpoint.interval import AutoInterval
from engine.checkpoint.latest import find_latest
from engine.checkpoint.layout import MARKER
from engine.checkpoint.load import load_latest, load_weights
from engine.checkpoint.save import prune_incomplete
from engine.checkpoint.save import save as save_checkpoint
from engine.runtime.fault_injection import FaultInjector

log = logging.getLogger(__name__)


class Part(Protocol):
    """A trained model saved with the policy in its own part (engine.train.units.NamedModel)."""

    chunks: list[Any]
    optimizer: Any
    scheduler: Any


class Checkpointer:
    """Resume / init_from / periodic saves through engine.checkpoint (save, load_latest, load_weights)."""

    def __init__(
        self,
        root: Path,
        save_interval: int,
        init_from: Path | None = None,
        keep_last: int = 2,
        async_save: bool = False,
        *,
        keep_incomplete: int = 1,
        peft: Any = None,
        max_failures: int = 3,
        faults: FaultInjector | None = None,
        auto_interval: AutoInterval | None = None,
    ) -> None:
        self.root = Path(root)
        self.save_interval = save_interval
        self.auto_interval = auto_interval
        """save_interval=auto: decides when periodic saves are due instead of ``save_interval``."""
        self.init_from = Path(init_from) if init_from else None
        self.keep_last = keep_last
        self.async_save = async_save
        """Periodic saves in the background (final and forced saves stay synchronous)."""
        self.keep_incomplete = keep_incomplete
        """Temp dirs of crashed saves kept (newest first); older ones are deleted at resume and after saves."""
        self.peft = peft
        """A PeftConfig with method=lora: checkpoints hold the adapters only, the base comes from init_from."""
        self.max_failures = max_failures
        """Consecutive failed saves that stop the run."""
        self.faults = faults
        """The stage's fault injector, checked inside each save (phases ckpt_write, ckpt_commit)."""
        self.finalize_seconds: list[float] = []
        """Wall time of each ``finalize`` call that committed an async save (also a training stall)."""
        self.last_saved: Path | None = None
        self.save_seconds: list[float] = []
        """Wall time of each save (the training stall)."""
        self.failures = 0
        self.base_loaded: Path | None = None
        """The base weights loaded from init_from (recorded in a LoRA stage's checkpoints)."""

    def restore(
        self,
        chunks: list[Any],
        optimizer: Any,
        scheduler: Any,
        init_weights: bool = True,
        models: Mapping[str, Part] | None = None,
    ) -> dict[str, Any] | None:
        """Resume from the newest good checkpoint under root (full state, returned); else load init_from weights.

        ``models``: the unit's other trained models (each restored from its own part of the checkpoint).
        """
        prune_incomplete(self.root, self.keep_incomplete)
        found = load_latest(  # verified while it loads; a bad one is skipped for the one before
            self.root,
            # a LoRA checkpoint holds the adapters: the base comes from init_from
            before_load=(lambda: self.load_init_weights(chunks)) if self.peft is not None else None,
            model_chunks=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            models=_parts(models),
        )
        if found is not None:
            return dict(found[1])
        if init_weights:
            self.load_init_weights(chunks)
        return None

    def load_init_weights(self, chunks: list[Any]) -> Path | None:
        """Load the weights of init_from (a checkpoint directory, or a root holding them); None if unset."""
        if self.init_from is None:
            return None
        from pipeline.schema.hf_arch import is_hf_dir

        if is_hf_dir(self.init_from):  # a Hugging Face model directory (init_from=hf:<dir>)
            from engine.models.hf_weights import load_hf
            from pipeline.schema.hf_arch import model_config

            load_hf(chunks, self.init_from, model_config(self.init_from))
            self.base_loaded = self.init_from
            return self.init_from
        path = self.init_from if (self.init_from / MARKER).is_file() else find_latest(self.init_from)
        if path is None:
            raise ValueError(f"init_from={self.init_from}: no complete checkpoint there")
        load_weights(path, chunks)
        self.base_loaded = path
        return path

    def maybe_save(
        self,
        step: int,
        final: bool,
        force: bool,
        chunks: list[Any],
        optimizer: Any,
        scheduler: Any,
        state: dict,
        models: Mapping[str, Part] | None = None,
        step_s: float | None = None,
    ) -> None:
        """Save at every ``save_interval`` (``auto_interval``: when it says so; ``step_s`` is the step's measured
        compute time), at the final step, and when ``force`` (a stop request).

        A failed periodic save (disk full, permission denied) is logged and retried at the next interval;
        ``max_failures`` failures in a row, or a failed final/forced save, stop the run.
        """
        auto = self.auto_interval
        periodic = auto.due(step, step_s) if auto is not None else step % self.save_interval == 0
        if not (final or force or periodic):
            return
        try:
            self.save(
                step,
                chunks,
                optimizer,
                scheduler,
                state,
                final=final,
                async_save=self.async_save and not force,
                **({"models": models} if models else {}),  # subclasses written before models stay valid
            )
            self.failures = 0
        except WRITE_FAILURES as e:  # CheckpointError, OSError, torch's CheckpointException (a full disk)
            self._failed(e, give_up=final or force, step=step)
        if auto is not None:  # after a failed save too: every rank re-chooses at the same step (collective)
            auto.saved(step, self.save_seconds, self.finalize_seconds)
            self.save_interval = auto.interval or self.save_interval

    def _failed(self, e: BaseException, give_up: bool, step: int | None = None) -> None:
        """Count a failed save; raise when it is the ``max_failures``-th in a row or ``give_up``."""
        self.failures += 1
        where = f"at step {step}" if step is not None else "(async)"
        log.error("checkpoint %s failed (%d in a row): %s: %s", where, self.failures, type(e).__name__, e)
        if give_up or self.failures >= self.max_failures:
            raise CheckpointError(
                f"giving up after {self.failures} failed save(s) in a row; last: {type(e).__name__}: {e}"
            ) from e

    def save(
        self,
        step: int,
        chunks: list[Any],
        optimizer: Any,
        scheduler: Any,
        state: dict,
        final: bool = False,
        async_save: bool = False,
        models: Mapping[str, Part] | None = None,
    ) -> Path:
        t0 = time.time()
        if self.peft is not None:
            from engine.models.lora import PEFT_STATE_KEY, record

            state = {**state, PEFT_STATE_KEY: record(self.peft, self.base_loaded)}
        self.last_saved = save_checkpoint(
            self.root,
            step,
            model_chunks=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            keep_last=self.keep_last,
            keep_incomplete=self.keep_incomplete,
            final=final,
            async_save=async_save,
            models=_parts(models),
            faults=self.faults,
        )
        self.save_seconds.append(time.time() - t0)
        return self.last_saved

    def finalize(self, blocking: bool = False) -> None:
        """Commit async saves whose writes are done (``blocking``: wait for them); collective, call every step."""
        t0 = time.time()
        pending = writer.pending_async()
        try:
            writer.finalize_async(blocking=blocking)
        except WRITE_FAILURES as e:  # an async save's write or commit failed: counted the same
            self._failed(e, give_up=blocking)
            return
        if pending > writer.pending_async():
            self.finalize_seconds.append(time.time() - t0)

    def reload_latest(
        self, chunks: list[Any], optimizer: Any, scheduler: Any, models: Mapping[str, Part] | None = None
    ) -> dict[str, Any] | None:
        """Full state of the newest good checkpoint (a rollback), after committing any save in flight; None if none."""
        self.finalize(blocking=True)
        found = load_latest(
            self.root, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, models=_parts(models)
        )
        return dict(found[1]) if found is not None else None


def _parts(models: Mapping[str, Part] | None) -> dict[str, tuple[list[Any], Any, Any]] | None:
    """The trained named models as checkpoint parts: name -> (chunks, optimizer, scheduler)."""
    if not models:
        return None
    return {n: (m.chunks, m.optimizer, m.scheduler) for n, m in models.items()}
