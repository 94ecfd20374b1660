"""PPO with a critic (``rlhf.algorithm=ppo``, ``PPOUnit`` + ``PPOStep``): GRPO's rollouts (engine.rl.grpo) plus a
trained critic ``V`` (the policy's architecture with the reward model's scalar head at every token, ``ValueStep``;
initialised from the stage's init_from, the SFT model; its own optimizer and checkpoint part). Steps 1-2 as
GRPO's; then:

3. scoring (each data-parallel rank its own rows): reference and old policy log-probs, the critic's values
   ``V_old`` at every position whose label is a response token (the value of the prefix before that token);
4. per-token rewards ``r_t = -beta * (old_logp_t - ref_logp_t)`` (the KL penalty, k1, in the rewards) plus
   the sequence's reward on its last token (``token_rewards``); GAE (``gae``, ``rlhf.gamma``, ``rlhf.lam``):
   advantages ``A`` and returns ``R = A + V_old``; ``A`` whitened over all response tokens of the rollout
   (the moments summed over the data-parallel ranks);
5. ``ppo_epochs`` critic updates minimising the token mean of
   ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` (c = ``rlhf.value_clip``), then
   ``ppo_epochs`` policy updates of the clipped loss of the per-token ``A`` (no KL term: it is in ``r``).

PPO's extra metrics: ``value_loss``, ``value_clip_frac``, ``value_grad_norm`` (of the critic's last update),
``value_mean`` and ``return_mean`` (over response tokens), ``explained_var`` (1 - Var(R - V_old) / Var(R)),
and ``time_critic_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.rl.grpo import GRPOStep, GRPOUnit, online_unit
from engine.rl.policy import ScoreStep, model_logits
from engine.rl.registry import Algorithm, RLInputs, register
from engine.runtime import distributed as D
from engine.train.steps import Batch, LossOut, _next_batch, _report
from engine.train.units import NamedModel, run_micro_batches


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (for PPO with a critic): advantages, returns.

    ``rewards``, ``values``, ``mask``: [b, T]; ``mask`` 1 on each row's tokens (a contiguous run from
    position 0 after alignment, right-padded). The value after a row's last token is 0 (the episode ends):
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, returns = A + V; 0 on padding.
    """
    m = mask.float()
    r, v = rewards.float() * m, values.float() * m
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    next_value = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = running
        next_value = v[:, t]
    return adv, (adv + v) * m


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` and where the
    clipped term is the larger (the clip is active)."""
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    plain, limited = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(plain, limited), (limited > plain).float()


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, beta: float
) -> torch.Tensor:
    """PPO's per-token rewards [b, s]: ``-beta * (logp - ref_logp)`` on every response token (the KL penalty
    to the reference, k1 estimator, folded into the rewards) plus the sequence's score [b] on its last one."""
    from engine.models.reward import last_index

    m = mask.float()
    r = -beta * (logp.float() - ref_logp.float()) * m
    rows = torch.arange(r.shape[0])
    r[rows, last_index(m)] += scores.float() * (m.sum(-1) > 0)
    return r


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, mean: float, std: float, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` where ``mask`` is 1, else 0 (PPO's advantages, with batch-wide moments)."""
    return (x - mean) / (std + eps) * mask.float()


class PPOStep(GRPOStep):
    """PPO's policy loss on a rollout micro batch: the clipped loss of per-token (whitened GAE) ``advantages``
    [b, s] against ``old_logp`` (the policy's log-probs when it sampled), no KL term (the KL penalty is in the
    rewards, ``token_rewards``); ``kl`` reports k3 to ``ref_logp`` as GRPO's does."""

    name = "ppo"

    def __init__(self, clip_eps: float = 0.2, temperature: float = 1.0) -> None:
        super().__init__(beta=0.0, clip_eps=clip_eps, temperature=temperature)


class ValueStep(ScoreStep):
    """The critic: per-token values [b, s] (the reward model's head at every position,
    engine.models.reward.token_values). With ``returns`` and ``old_values`` in the batch: the clipped
    value loss over response tokens (``clipped_value_loss``); without: forward-only scoring (``values``)."""

    name = "value"
    sequences_per_sample = 1
    metric_names: tuple[str, ...] = ("value_loss", "value_clip_frac")
    output_key = "values"

    def __init__(self, value_clip: float = 0.2) -> None:
        if value_clip <= 0:
            raise ValueError(f"value_clip={value_clip}: must be > 0")
        self.value_clip = value_clip

    def __call__(
        self, data_iterator: Iterator[Batch], model: Any
    ) -> tuple[torch.Tensor, Callable[..., LossOut]]:
        from engine.models.gpt import unwrap
        from engine.models.reward import token_values

        batch = _next_batch(data_iterator)
        output = model_logits(model, batch["tokens"])
        gpt = unwrap(model)
        if gpt.post_process:
            output = token_values(gpt)
        return output, partial(self.loss, batch)

    def loss(self, batch: Batch, values: torch.Tensor) -> LossOut:
        if "returns" not in batch:
            n = torch.tensor(1, dtype=torch.int, device=values.device)
            return values.sum() * 0, n, {"values": values.detach()}
        mask = batch["loss_mask"].float()
        vl, clipped = clipped_value_loss(values, batch["old_values"], batch["returns"], self.value_clip)
        loss = (vl * mask).sum()
        n = mask.sum()
        return (
            loss,
            n.to(torch.int),
            {"value_loss": _report(loss, n), "value_clip_frac": _report((clipped * mask).sum(), n)},
        )


@dataclass
class PPOUnit(GRPOUnit):
    """PPO's unit: the policy (the trainer's), a frozen ``reference`` and a trained ``critic`` (own optimizer,
    schedule and checkpoint part); one global step (the module docstring's PPO part):

    rollouts as GRPO's; scoring: reference and old policy log-probs, the critic's values; per-token rewards
    (``token_rewards``: KL penalty + the score on the last response token); GAE advantages and returns
    (``gae``), advantages whitened over the rollout's response tokens (all data-parallel ranks); then
    ``ppo_epochs`` critic updates (clipped value loss) here, and the trainer's ``ppo_epochs`` policy updates
    (``PPOStep``) over the same micro batches.
    """

    def _credit(self, arrays: dict[str, np.ndarray], rewards: np.ndarray, own: range) -> None:
        # placed on each response's last token once the log-probs are known
        arrays["score"] = rewards[own.start : own.stop]

    def updates(self, step: int) -> list[list[Batch]]:
        t, st = self._t(), self.settings
        critic = self.models["critic"]
        arrays, self._last = self._rollout(step)
        batches = self._batches(arrays)
        with t.meter.time("score"):
            self._score(self.models["reference"].chunks, batches, "ref_logp")
            self._score(t.chunks, batches, "old_logp")
            self._score(critic.chunks, batches, "old_values", ValueStep(st.value_clip))
        for b in batches:
            rewards = token_rewards(b["score"], b["loss_mask"], b["old_logp"], b["ref_logp"], st.beta)
            b["advantages"], b["returns"] = gae(rewards, b["old_values"], b["loss_mask"], st.gamma, st.lam)
        self._last.update(self._whiten(batches))
        with t.meter.time("critic"):
            self._last.update(self._train_critic(critic, batches))
        return [batches] * st.ppo_epochs

    def _whiten(self, batches: list[Batch]) -> dict[str, float]:
        """Whiten the advantages with the moments of all response tokens of the rollout (summed over the
        loss-owning ranks); the critic's metrics of the rollout: ``value_mean``, ``explained_var``."""
        sums = np.zeros(8, dtype=np.float64)
        if D.owns_loss():
            for b in batches:
                m = b["loss_mask"].double()
                a, v, r = (b[k].double() * m for k in ("advantages", "old_values", "returns"))
                d = r - v
                sums += [float(x.sum()) for x in (m, a, a * a, v, r, r * r, d, d * d)]
        n, sa, saa, sv, sr, srr, sd, sdd = D.all_reduce_sum(sums)
        n = max(n, 1.0)
        mean = sa / n
        std = float(np.sqrt(max(saa / n - mean * mean, 0.0)))
        for b in batches:
            b["advantages"] = masked_whiten(b["advantages"], b["loss_mask"], mean, std)
        var_r = srr / n - (sr / n) ** 2
        var_d = sdd / n - (sd / n) ** 2
        return {
            "value_mean": sv / n,
            "return_mean": sr / n,
            "explained_var": float(1 - var_d / var_r) if var_r > 1e-12 else 0.0,
        }

    def _train_critic(self, critic: NamedModel, batches: list[Batch]) -> dict[str, float]:
        """``ppo_epochs`` updates of the critic on the rollout (its own optimizer; its LR schedule advances
        once per global step). Its steps are not judged by nan_policy (the policy's are)."""
        t, st = self._t(), self.settings
        step = ValueStep(st.value_clip)
        sums: dict[str, list[float]] = {}
        grad_norm = None
        for c in critic.chunks:
            c.train()
        for _ in range(st.ppo_epochs):
            for c in critic.chunks:
                c.zero_grad_buffer()
            critic.optimizer.zero_grad()
            outputs = run_micro_batches(
                critic.chunks,
                step,
                batches,
                seq_length=t.seq_length,
                micro_batch_size=st.parallel.micro_batch_size,
                forward_only=False,
            )
            _, grad_norm, _ = critic.optimizer.step()
            for out in outputs:
                for k, v in out.items():
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += float(v[0])
                    acc[1] += float(v[1])
        critic.scheduler.step(increment=1)
        metrics = D.reduce_metrics({k: tuple(sums.get(k, (0.0, 0.0))) for k in step.metric_names})
        metrics["value_grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return metrics


def critic_model(env: Any) -> NamedModel:
    """PPO's critic: the policy's architecture with the reward model's scalar head at every token,
    initialised from the stage's ``init_from`` (the SFT model; the head as drawn by its global name, bias 0),
    trained with its own optimizer (``rlhf.critic_lr``, the policy's schedule shape) and checkpointed as its
    own part (``critic.model`` / ``critic.optimizer``)."""
    import dataclasses

    from engine.models.reward import build
    from engine.rl.frozen_reward import load_backbone
    from engine.train.optimizer import build_optimizer

    st = env.stage
    chunks = build(env.cfg.model, st.parallel, env.tokenizer.vocab_size, trainable=True)
    if env.checkpointer.init_from is not None:
        load_backbone(env.checkpointer.init_from, chunks)
    lr = st.critic_lr if st.critic_lr is not None else st.lr
    optimizer, scheduler = build_optimizer(
        chunks, dataclasses.replace(st, lr=lr, min_lr=min(st.min_lr, lr)), st.parallel
    )
    return NamedModel("critic", chunks, optimizer, scheduler)


def ppo_unit(env: Any, inputs: RLInputs) -> tuple[GRPOUnit, None]:
    """PPO's unit: GRPO's inputs and reference, plus the trained critic."""
    return online_unit(env, inputs, PPOUnit, lambda env: {"critic": critic_model(env)})


ALGORITHM = register(
    Algorithm(
        "ppo",
        step=lambda st: PPOStep(clip_eps=st.clip_eps, temperature=st.temperature),
        unit=ppo_unit,
    )
)
