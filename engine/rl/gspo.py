"""GSPO (``rlhf.algorithm=gspo``; Zheng et al. 2025, "Group Sequence Policy Optimization"): GRPO's rollouts,
rewards and group advantages (engine.rl.grpo) with the importance ratio, its clipping and the loss per
sequence, not per token:

    s_i = exp(mean over response tokens t of (logp_t - old_logp_t))   (the length-normalised sequence ratio)
    loss = mean over sequences of  -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i) + beta * KL_i

``KL_i`` is the token mean of GRPO's k3 estimate over the sequence's response tokens. The clip range is
that of a sequence ratio, much narrower than a token ratio's (``conf/rlhf/gspo.yaml``: 3e-4 / 4e-4, the
paper's values). ``clip_frac`` is the share of sequences whose clip is active; ``kl`` and ``entropy`` stay
per-token means.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.rl.grpo import GRPOStep, GRPOUnit, online_unit, policy_loss_out
from engine.rl.policy import clipped_ratio_loss, kl_k3
from engine.rl.registry import Algorithm, RLInputs, register
from engine.train.steps import Batch, LossOut, _report


class GSPOStep(GRPOStep):
    """The sequence-level clipped loss (module docstring) on GRPO's rollout micro batches."""

    name = "gspo"

    def loss_count(self, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """A mean over sequences: the rows with response tokens."""
        return (mask.sum(dim=1) > 0).sum()

    def loss_from_logps(self, batch: Batch, logp: torch.Tensor) -> LossOut:
        mask = batch["loss_mask"].float()
        old = batch["old_logp"] if "old_logp" in batch else logp.detach()
        per_row = mask.sum(dim=1)
        rows = (per_row > 0).float()
        length = per_row.clamp(min=1)
        ratio = torch.exp(((logp - old) * mask).sum(dim=1) / length)
        pg, clipped = clipped_ratio_loss(ratio, batch["advantages"].float(), self.clip_eps, self.clip_high)
        kl = kl_k3(logp, batch["ref_logp"])
        kl_row = (kl * mask).sum(dim=1) / length
        loss = ((pg + self.beta * kl_row if self.beta else pg) * rows).sum()
        count = self.loss_count(mask, mask.sum())
        return policy_loss_out(loss, count, logp, kl, mask, _report((clipped * rows).sum(), count))


def gspo_unit(env: Any, inputs: RLInputs) -> tuple[GRPOUnit, None]:
    return online_unit(env, inputs, GRPOUnit)


ALGORITHM = register(
    Algorithm(
        "gspo",
        step=lambda st: GSPOStep(
            beta=st.beta, clip_eps=st.clip_low, clip_high=st.clip_high, temperature=st.temperature
        ),
        unit=gspo_unit,
    )
)
