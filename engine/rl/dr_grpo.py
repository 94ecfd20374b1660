"""Dr. GRPO (``rlhf.algorithm=dr_grpo``; Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
Perspective"): GRPO (engine.rl.grpo) without its two normalisations that bias the optimisation:

- advantages ``A = r - mean_g`` (no division by the group's std, ``dr_group_advantages``);
- the loss sum over response tokens is divided by a constant, ``rlhf.max_new_tokens`` per response
  (``DrGRPOStep.loss_count``: rows x max_new_tokens over the whole batch), not by the number of response
  tokens, so a long wrong answer is not penalised less per token than a short one.

Rollouts, rewards, scoring, the clipped ratio and the k3 KL penalty are GRPO's. The ``kl``, ``entropy`` and
``clip_frac`` metrics stay per-token means; ``loss`` is the loss sum over rows x max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.rl.grpo import GRPOStep, GRPOUnit, online_unit
from engine.rl.registry import Algorithm, RLInputs, register


def dr_group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Dr. GRPO advantages: each reward minus its group's mean (no std division).

    ``rewards``: [n_prompts * group_size], each prompt's samples contiguous. Returns float32, same shape.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards of shape {r.shape}: expected [n * group_size={group_size}]")
    g = r.reshape(-1, group_size)
    return (g - g.mean(axis=1, keepdims=True)).reshape(-1).astype(np.float32)


class DrGRPOStep(GRPOStep):
    """GRPO's clipped loss with the KL penalty, divided by ``max_new_tokens`` per response, not per token."""

    name = "dr_grpo"

    def __init__(
        self, beta: float = 0.04, clip_eps: float = 0.2, temperature: float = 1.0, max_new_tokens: int = 8
    ) -> None:
        super().__init__(beta=beta, clip_eps=clip_eps, temperature=temperature)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        self.max_new_tokens = max_new_tokens

    def loss_count(self, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tensor(mask.shape[0] * self.max_new_tokens, dtype=torch.float32, device=mask.device)


@dataclass
class DrGRPOUnit(GRPOUnit):
    """GRPO's unit with Dr. GRPO's advantages (``dr_group_advantages``, group means over the whole batch)."""

    def _credit(self, arrays: dict[str, np.ndarray], rewards: np.ndarray, own: range) -> None:
        arrays["advantages"] = dr_group_advantages(rewards, self.settings.group_size)[own.start : own.stop]


def dr_grpo_unit(env: Any, inputs: RLInputs) -> tuple[GRPOUnit, None]:
    return online_unit(env, inputs, DrGRPOUnit)


ALGORITHM = register(
    Algorithm(
        "dr_grpo",
        step=lambda st: DrGRPOStep(
            beta=st.beta, clip_eps=st.clip_eps, temperature=st.temperature, max_new_tokens=st.max_new_tokens
        ),
        unit=dr_grpo_unit,
    )
)
