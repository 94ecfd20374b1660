"""DAPO (``rlhf.algorithm=dapo``; Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): GRPO (engine.rl.grpo) with four changes:

- clip-higher: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``, ``clip_high > clip_low`` leaving
  room for unlikely tokens to gain probability (``DAPOStep``);
- dynamic sampling: a group whose rewards are all equal has zero advantage and teaches nothing; such groups
  are dropped and the batch refilled from the next prompts of the stream, up to ``sampling_rounds`` rounds of
  ``global_batch_size`` rollouts per step (the informative groups first, in sampling order, then, when the
  rounds ran out, the dropped ones in order, so the batch keeps its shape). The stream's position is the
  unit's state (saved in checkpoints), not a function of the step;
- token-level loss: the loss is the mean over every response token of the batch (GRPO's here already);
- overlong shaping: a response longer than ``max_new_tokens - overlong_buffer`` tokens loses
  ``overlong_penalty`` x the share of the buffer it used from its reward (``overlong_penalty``), and with
  ``overlong_filter`` a response cut at ``max_new_tokens`` (no stop token) is left out of the loss.

The KL penalty is GRPO's (``beta``; the paper uses none: ``conf/rlhf/dapo.yaml`` sets ``beta: 0``). Metrics
add ``sampling_rounds`` (rollout rounds of the step) and ``groups_kept`` (the share of sampled groups with
differing rewards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.rl.grpo import GRPOStep, GRPOUnit, Sampled, online_unit, rollout_metrics
from engine.rl.registry import Algorithm, RLInputs, register
from engine.rl.rollout import sample_seed
from engine.runtime import distributed as D


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment per response of ``lengths`` tokens: 0 up to ``max_new_tokens -
    buffer``, then falling linearly to ``-factor`` at ``max_new_tokens`` (float32; all 0 when ``buffer`` is 0)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros(lengths.shape, dtype=np.float32)
    over = np.clip(lengths - (max_new_tokens - buffer), 0, buffer)
    return (-factor * over / buffer).astype(np.float32)


def informative_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per group of ``group_size`` contiguous rewards: whether they differ (a group of equal rewards has zero
    advantage)."""
    g = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return np.asarray(g.max(axis=1) > g.min(axis=1))


def select_groups(
    pool: list[tuple[dict[str, np.ndarray], np.ndarray]], groups: int, group_size: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The batch of ``groups`` groups from the sampled rounds ``pool`` ((every row's arrays, every row's
    ``Sampled.whole``) per round): the informative groups in sampling order, then the others in order."""
    arrays = {k: np.concatenate([a[k] for a, _ in pool]) for k in pool[0][0]}
    whole = np.concatenate([w for _, w in pool])
    keep = informative_groups(whole[:, 0], group_size)
    order = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)])[:groups]
    rows = (order[:, None] * group_size + np.arange(group_size)).reshape(-1)
    return {k: v[rows] for k, v in arrays.items()}, whole[rows]


def gather_rows(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every data-parallel rank's rows of ``arrays``, in rank order, with their dtypes (ids are exact in float64)."""
    return {k: D.dp_all_gather(v).astype(v.dtype) for k, v in arrays.items()}


class DAPOStep(GRPOStep):
    """GRPO's loss with the ratio clipped to ``[1 - clip_low, 1 + clip_high]``."""

    name = "dapo"


@dataclass
class DAPOUnit(GRPOUnit):
    """GRPO's unit with overlong shaping and dynamic sampling (module docstring)."""

    def _shape(self, rewards: np.ndarray, gen: Any) -> np.ndarray:
        st = self.settings
        lengths = np.array([len(x) for x in gen.tokens])
        return rewards + overlong_penalty(lengths, st.max_new_tokens, st.overlong_buffer, st.overlong_penalty)

    def _rollout(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        st = self.settings
        g = st.group_size
        groups = st.parallel.global_batch_size // g
        pool: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
        start, gen_s, kept, last = self.position, 0.0, 0, None
        while len(pool) < st.sampling_rounds and kept < groups:
            last = self._sample(start, sample_seed(st.seed, step, D.dp_rank(), len(pool)))
            start, gen_s = start + groups, gen_s + last.gen_s
            pool.append((gather_rows(self._filtered(last)), last.whole))
            kept += int(informative_groups(last.whole[:, 0], g).sum())
        assert last is not None
        batch, whole = select_groups(pool, groups, g)
        self.position = start
        own = last.own
        arrays = {k: v[own.start : own.stop] for k, v in batch.items()}
        self._credit(arrays, whole[:, 0].astype(np.float32), own)
        metrics = rollout_metrics(whole, gen_s)
        metrics.update(
            gen_tokens_per_s=float(sum(w[:, 2].sum() for _, w in pool)) / max(gen_s, 1e-9),
            sampling_rounds=float(len(pool)),
            groups_kept=kept / (groups * len(pool)),
        )
        return arrays, metrics

    def _filtered(self, sampled: Sampled) -> dict[str, np.ndarray]:
        """The sampled rows' arrays; with ``overlong_filter``, the rows cut at max_new_tokens out of the loss."""
        arrays = dict(sampled.arrays)
        if self.settings.overlong_filter:
            cut = ~np.asarray(sampled.stopped, dtype=bool)
            arrays["loss_mask"] = np.where(cut[:, None], 0.0, arrays["loss_mask"]).astype(np.float32)
        return arrays


def dapo_unit(env: Any, inputs: RLInputs) -> tuple[GRPOUnit, None]:
    return online_unit(env, inputs, DAPOUnit)


ALGORITHM = register(
    Algorithm(
        "dapo",
        step=lambda st: DAPOStep(
            beta=st.beta, clip_eps=st.clip_low, clip_high=st.clip_high, temperature=st.temperature
        ),
        unit=dapo_unit,
    )
)
