"""What a training step trains: the unit the loop (engine.train.trainer.Trainer) drives.

The trainer owns the *policy*: its chunks, optimizer and LR schedule (the model the stage writes out).
A ``TrainUnit`` decides what each optimizer step sees and which other named models take part:

- ``updates(step)``: the micro batches of every optimizer update of global step ``step`` (one update for
  pretrain / SFT / DPO; ``ppo_epochs`` updates over one rollout for GRPO), as lists of CPU tensor dicts;
- ``models``: other named models (``NamedModel``): frozen ones (the RL reference, a reward model) have no
  optimizer and are loaded from their source (the stage's ``init_from``) at every start, so they are not
  written into checkpoints; trained ones (a critic) carry their own optimizer and schedule, and the
  checkpoint holds their own part (``<name>.model`` / ``<name>.optimizer``, engine.checkpoint.save);
- ``state()`` / ``load_state()``: the unit's plain resumable values (the position in a prompt stream, the
  sampler's seed scheme), saved in the checkpoint's common state next to the trainer's;
- ``metrics()``: extra values of the last step for the ``train`` line (RL: reward mean/std, ...).

The loop stays one loop: ``Trainer.train_step`` runs the updates, judges each optimizer step (nan_policy)
and advances the LR schedule once per global step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from engine.data.datasets import collate, sample_range
from engine.data.truncation import Truncation
from engine.runtime import distributed as D
from engine.train.meter import StepMeter
from engine.train.step import Batch, ForwardStep
from pipeline.schema.config import TrainStage


class SampleSource(Protocol):
    """Samples by global index: dicts of numpy arrays (engine.data.sources)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...


class Loop(Protocol):
    """What a unit reads from the loop that drives it (engine.train.trainer.Trainer is one)."""

    chunks: list[Any]
    """The policy's model chunks."""
    stage: TrainStage
    """The stage's config section (its parallel layout: batch sizes)."""
    seq_length: int
    meter: StepMeter
    """Times the parts of a step (``meter.time("data")``)."""


def micro_batches(source: Any, step: int, global_batch: int, micro_batch: int) -> list[Batch]:
    """This data-parallel rank's micro batches at ``step`` (global sample index), as CPU tensors."""
    idx = sample_range(step, global_batch, D.dp_rank(), D.dp_size())
    out = []
    for start in range(idx.start, idx.stop, micro_batch):
        batch = collate([source[i] for i in range(start, min(start + micro_batch, idx.stop))])
        out.append({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()})
    return out


def run_micro_batches(
    chunks: list[Any],
    step: ForwardStep,
    batches: list[Batch],
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    """Run ``step`` over ``batches`` with megatron's schedule (no pipelining, 1F1B or interleaved).

    ``forward_only``: no backward (scoring: reference log-probs, old log-probs, evaluation). Returns what the
    step's loss function reported per micro batch (on the last pipeline stage; empty elsewhere).
    ``micro_batch_size``: sequences per micro batch as the model sees them (DPO: 2 x pairs).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(  # type: ignore[no-any-return]
        forward_step_func=step,
        data_iterator=_iterators(batches, len(chunks)),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def _iterators(batches: list[Batch], chunks: int) -> Iterator[Batch] | list[Iterator[Batch]]:
    """One iterator, or one per virtual pipeline chunk (each chunk walks all micro batches)."""
    return iter(batches) if chunks == 1 else [iter(batches) for _ in range(chunks)]


@dataclass
class NamedModel:
    """A model of the unit besides the policy: frozen (``optimizer`` None) or trained with its own optimizer."""

    name: str
    chunks: list[Any]
    optimizer: Any = None
    scheduler: Any = None
    init: str = "init_from"
    """Where a frozen model's weights come from at every start: ``init_from`` (the stage's starting weights,
    the policy before training) or ``built`` (kept as built)."""

    @property
    def trained(self) -> bool:
        return self.optimizer is not None


@dataclass
class TrainUnit:
    """The default unit: one trained policy on a sample source (the global sample index)."""

    source: Any
    models: dict[str, NamedModel] = field(default_factory=dict)
    trainer: Loop | None = field(default=None, repr=False)
    truncation: Truncation | None = None
    """What cutting its examples at the sequence length cost (engine.data.truncation; None: nothing is cut)."""

    def bind(self, trainer: Loop) -> None:
        """Called by the trainer it belongs to (gives the unit the stage, meter and the policy)."""
        self.trainer = trainer

    def _t(self) -> Loop:
        if self.trainer is None:
            raise RuntimeError("TrainUnit is not bound to a Trainer")
        return self.trainer

    def updates(self, step: int) -> list[list[Batch]]:
        t = self._t()
        par = t.stage.parallel
        with t.meter.time("data"):
            return [micro_batches(self.source, step, par.global_batch_size, par.micro_batch_size)]

    def metrics(self) -> dict[str, float]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        del state

    def trained_models(self) -> dict[str, NamedModel]:
        return {n: m for n, m in self.models.items() if m.trained}

    def load_frozen(self, checkpointer: Any) -> None:
        """Load every frozen model's weights from its source (at each start: fresh or resumed)."""
        for m in self.models.values():
            if not m.trained and m.init == "init_from" and checkpointer is not None:
                checkpointer.load_init_weights(m.chunks)
            if not m.trained:
                for c in m.chunks:
                    c.eval()


def frozen(chunks: list[Any]) -> list[Any]:
    """``chunks`` with gradients off (a frozen model of a unit)."""
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(False)
        c.eval()
    return chunks


def local_outputs(outputs: list[dict[str, torch.Tensor]], key: str, like: list[Batch]) -> list[torch.Tensor]:
    """Per micro batch, the ``key`` tensor a forward-only pass reported (last stage), zeros elsewhere.

    Only the last pipeline stage computes losses, so only there do the values exist; other stages get
    zeros of the micro batches' [b, s] shape (their steps never read them).
    """
    if D.is_last_stage() and outputs:
        return [o[key].detach().float().cpu() for o in outputs]
    return [torch.zeros(b["tokens"].shape, dtype=torch.float32) for b in like]


def as_tensors(arrays: dict[str, np.ndarray]) -> Batch:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
