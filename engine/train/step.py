"""What the loop (engine.train.trainer) and units (engine.train.units) need from a training step.

A step is megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)``; ``loss_func(output)``
returns ``(loss_sum, num_tokens, {name: tensor([sum, count])})`` (engine.train.steps). ``Step`` adds what the
loop reads around it; its optional hooks have defaults here, so a step class subclasses ``Step`` and
overrides only what it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

Batch = dict[str, torch.Tensor]
LossOut = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
ForwardStep = Callable[[Iterator[Batch], Any], tuple[torch.Tensor, Callable[..., LossOut]]]
"""megatron's ``forward_step_func`` shape: what ``run_micro_batches`` runs (a ``Step`` or a wrapper of one)."""


class Step(Protocol):
    """A training (or scoring) step: the forward step plus what the loop reads about it."""

    name: str
    sequences_per_sample: int = 1
    """Sequences the model sees per sample (pairs: 2): micro batch size and token counts scale by it."""
    metric_names: tuple[str, ...] = ()
    """The names the loss function reports that the loop reduces and logs (``train`` / ``valid`` lines)."""

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]: ...

    def customize_model(self, gpt: Any) -> Any:
        """Adds modules to each GPTModel before its weights are drawn (engine.models.gpt.build_model); default:
        none."""
        return gpt
