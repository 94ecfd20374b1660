"""Rollout inputs of the online algorithms: the seeded prompt stream, the sampler's seed per step and rank, and
the training rows of sampled responses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PromptStream:
    """Prompts (token ids: the run's chat template up to its generation prompt) in a seeded order per epoch;
    any index >= 0."""

    prompts: list[list[int]]
    seed: int
    _perms: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("prompt stream: no prompts")

    def take(self, start: int, n: int) -> list[list[int]]:
        out = []
        for i in range(start, start + n):
            epoch, j = divmod(i, len(self.prompts))
            if epoch not in self._perms:
                self._perms = {
                    epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
                }
            out.append(self.prompts[int(self._perms[epoch][j])])
        return out


def sample_seed(seed: int, step: int, dp_rank: int = 0, round: int = 0) -> int:
    """The sampler's seed of data-parallel rank ``dp_rank`` at global step ``step`` (and sampling ``round`` of
    the step: DAPO's refills): a function of them and the stage seed, so a resumed run on the same layout
    redraws alike. Rank 0 keeps ``(seed, step)``: a single-rank run draws as it did before rollouts were
    split over data-parallel ranks; round 0 is the step's first draw of every algorithm."""
    entropy = [seed, step] if dp_rank == 0 else [seed, step, dp_rank]
    if round:
        entropy = [seed, step, dp_rank, round]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def rollout_rows(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    ends: Sequence[int | None],
    seq_length: int,
    pad: int,
) -> dict[str, np.ndarray]:
    """Training rows of prompt + response (+ the stop token the sampler stopped on: ``ends``, None where it
    ran to its length), right-padded.

    ``tokens``/``labels`` (next token) int64 and ``loss_mask`` float32 [n, seq_length]; the loss covers the
    response tokens and the closing stop token.
    """
    n = len(prompts)
    tokens = np.full((n, seq_length), pad, dtype=np.int64)
    labels = np.full((n, seq_length), pad, dtype=np.int64)
    mask = np.zeros((n, seq_length), dtype=np.float32)
    for i, (p, r, e) in enumerate(zip(prompts, responses, ends)):
        ids = [*p, *r, *([e] if e is not None else [])]
        if len(ids) > seq_length + 1:
            raise ValueError(
                f"rollout of {len(ids)} tokens exceeds rlhf.seq_length={seq_length} + 1: lower "
                "rlhf.max_new_tokens or raise rlhf.seq_length"
            )
        k = len(ids) - 1
        tokens[i, :k] = ids[:-1]
        labels[i, :k] = ids[1:]
        mask[i, len(p) - 1 : k] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}
