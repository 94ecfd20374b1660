"""Training steps in megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)`` shape.

The data iterator yields micro batches: dicts of CPU tensors stacked from sample-source items
(``tokens``/``labels`` int64 and ``loss_mask`` float32 of shape [b, seq]; pairs: [b, 2, seq]). ``loss_func(output)`` returns ``(loss_sum, num_tokens, {name: tensor([sum, count])})``:
megatron (``calculate_per_token_loss=True``) divides the gradients by the global ``num_tokens``, and the
trainer reports each logged metric as global sum / global count.

Register new steps in ``STEPS``; the RL algorithms' steps live in engine.rl (engine.rl.registry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from engine.runtime import distributed as D
from engine.train.step import Batch, LossOut, Step

__all__ = ["STEPS", "Batch", "LossOut", "PretrainStep", "RewardStep", "SFTStep", "make_step"]


def _next_batch(data_iterator: Iterator[Batch]) -> Batch:
    """The next micro batch, moved to the engine's device (engine.runtime.distributed.device)."""
    dev = D.device()
    return {k: v.to(dev, non_blocking=True) for k, v in next(data_iterator).items()}


def _per_token_nll(
    model: Any, tokens: torch.Tensor, labels: torch.Tensor, packed: Batch | None = None
) -> torch.Tensor:
    """Model output: per-token negative log-likelihood [b, s] on the last pipeline stage, else hidden states.

    ``packed``: a batch of packed rows (``segment_ids`` present): its ``position_ids`` restart per example
    and attention stays within each example (a block-diagonal causal mask).
    """
    b, s = tokens.shape
    if packed is not None and "segment_ids" in packed:
        from engine.models.attention import block_causal_mask

        mask = block_causal_mask(packed["segment_ids"])
        return model(tokens, packed["position_ids"], mask, labels=labels)
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, None, labels=labels)


def _report(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.stack([total.detach().float(), count.detach().float()])


class PretrainStep(Step):
    """Next-token loss on tokens where ``loss_mask`` is 1 (the data shifts labels by one)."""

    name = "pretrain"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ("loss",)

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        output = _per_token_nll(model, batch["tokens"], batch["labels"], batch)
        return output, partial(self.loss, batch["loss_mask"])

    @staticmethod
    def loss(loss_mask: torch.Tensor, output: torch.Tensor) -> LossOut:
        mask = loss_mask.reshape(-1).float()
        loss = torch.sum(output.reshape(-1).float() * mask)
        num_tokens = mask.sum().to(torch.int)
        return loss, num_tokens, {"loss": _report(loss, num_tokens)}


class SFTStep(PretrainStep):
    """Same code path as pretraining; the data's loss_mask covers response tokens only."""

    name = "sft"


class RewardStep(Step):
    """Bradley–Terry reward-model training: ``loss = -log sigmoid(r(chosen) - r(rejected))`` per pair, with
    r the scalar head on the final hidden state at the last response token (``engine.models.reward``).

    Chosen and rejected go through the model as one batch of 2b sequences; num_tokens = number of pairs.
    ``customize_model`` adds the head (``train_stage`` passes it to ``build_model``).
    """

    name = "reward"
    sequences_per_sample = 2
    metric_names: tuple[str, ...] = ("loss", "accuracy", "margin")

    def customize_model(self, gpt: Any) -> Any:
        from engine.models.reward import attach_head

        return attach_head(gpt)

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        from engine.models.gpt import unwrap
        from engine.models.reward import last_index, scores

        batch = _next_batch(data_iterator)
        tokens = batch["tokens"].flatten(0, 1)
        b, s = tokens.shape
        output = model(tokens, torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s), None)
        gpt = unwrap(model)
        if gpt.post_process:
            output = scores(gpt, last_index(batch["loss_mask"].flatten(0, 1)))
        return output, self.loss

    @staticmethod
    def loss(output: torch.Tensor) -> LossOut:
        from engine.models.reward import bradley_terry

        rewards = output.float().reshape(-1, 2)
        loss, correct, margin = bradley_terry(rewards)
        pairs = torch.tensor(rewards.shape[0], dtype=torch.int, device=rewards.device)
        return (
            loss,
            pairs,
            {
                "loss": _report(loss, pairs),
                "accuracy": _report(correct, pairs),
                "margin": _report(margin, pairs),
            },
        )


STEPS: dict[str, Callable[..., Step]] = {
    "pretrain": PretrainStep,
    "sft": SFTStep,
    "reward": RewardStep,
}


def make_step(name: str, **kwargs: Any) -> Step:
    """A step by name (``STEPS``), e.g. ``make_step("pretrain")``; the RL steps are engine.rl's (engine.rl.registry)."""
    if name not in STEPS:
        raise ValueError(f"algorithm={name!r}: must be one of {sorted(STEPS)}")
    return STEPS[name](**kwargs)
