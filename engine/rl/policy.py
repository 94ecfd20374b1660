"""What the policy-gradient algorithms share: per-token log-probs at the sampling temperature, the k3 KL
estimate, the PPO-clip policy loss, and forward-only log-prob scoring (``LogpStep``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Protocol

import torch

from engine.train.step import Step
from engine.train.steps import Batch, LossOut, _next_batch


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased on samples of pi)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(ratio * A, clip(ratio, 1-eps, 1+eps_high) * A)`` and where the clip is
    active; ``eps_high`` is ``clip_eps`` unless given (DAPO's clip-higher).

    ``advantages`` broadcasts against ``logp`` ([b, 1] per sequence for GRPO).
    """
    return clipped_ratio_loss(torch.exp(logp - old_logp), advantages, clip_eps, clip_high)


def clipped_ratio_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` and where the clip is active, for
    any ratio: per token (GRPO, DAPO) or per sequence (GSPO)."""
    high = clip_low if clip_high is None else clip_high
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(label) per position [b, s] from (tensor-parallel) logits [b, s, vocab / tp] divided by ``temperature``.

    The padded vocabulary entries are -inf in the model's logits (engine.models.gpt.mask_padded_vocab): the
    softmax is over the real vocabulary at any layout."""
    from megatron.core import tensor_parallel

    scaled = logits.float() / temperature  # a new tensor: megatron's cross entropy works in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


def model_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Model output: logits [b, s, vocab / tp] on the last pipeline stage, hidden states elsewhere."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, None)  # type: ignore[no-any-return]


class ScoreStep(Step, Protocol):
    """A forward-only scoring step: its loss function reports the per-token ``output_key`` tensor [b, s]."""

    output_key: str


class LogpStep(ScoreStep):
    """Forward-only scoring: per-token log-probs [b, s] at ``temperature`` (reported as ``logps``)."""

    name = "logp"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ()
    output_key = "logps"

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        batch = _next_batch(data_iterator)
        return model_logits(model, batch["tokens"]), partial(self.logps, batch["labels"])

    def logps(self, labels: torch.Tensor, logits: torch.Tensor) -> LossOut:
        logp = token_logps(logits, labels, self.temperature).detach()
        n = torch.tensor(1, dtype=torch.int, device=logp.device)
        return logp.sum() * 0, n, {"logps": logp}
