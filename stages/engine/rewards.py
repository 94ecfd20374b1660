"""Rewards for online RL: a callable ``reward(prompts, responses) -> np.ndarray`` (float32, one per response).

``prompts`` and ``responses`` are token-id lists of equal count: the prompt as the model saw it
(``<|user|>...<|assistant|>``) and the sampled response (the closing eod not included). Every rank calls
the reward with the same rollouts and must get the same values (deterministic, no per-rank state).

Sources (``rlhf.reward``; ``make_reward``):
- ``verifier``: the task checker (stages.tasks.is_correct): 1.0 for the right answer, else 0.0.
- ``model`` / ``both``: a trained reward model, added with the reward-model stage (not in this version).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class Reward(Protocol):
    def __call__(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> np.ndarray: ...


class VerifierReward:
    """1.0 when the decoded response is the prompt's right answer (``stages.tasks.is_correct``), else 0.0.

    The expected answer comes from ``answers`` (prompt token ids -> answer text: the prompt stream's own
    records), else from parsing the prompt text (``stages.tasks.parse_prompt``).
    """

    def __init__(self, tokenizer: Any, answers: Mapping[tuple[int, ...], str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.answers = dict(answers or {})

    def expected(self, prompt: Sequence[int]) -> str:
        key = tuple(int(t) for t in prompt)
        if key in self.answers:
            return self.answers[key]
        from stages import tasks

        special = set(self.tokenizer.special_ids.values())
        text = self.tokenizer.decode([t for t in key if t not in special])
        return tasks.parse_prompt(text).answer

    def __call__(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> np.ndarray:
        from stages import tasks

        if len(prompts) != len(responses):
            raise ValueError(f"reward: {len(prompts)} prompts but {len(responses)} responses")
        special = set(self.tokenizer.special_ids.values())
        out = np.zeros(len(prompts), dtype=np.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if any(int(t) in special for t in r):
                continue  # a special token inside the answer is never right
            out[i] = float(tasks.is_correct(self.tokenizer.decode(r), self.expected(p)))
        return out


REWARDS = ("verifier",)
"""Reward sources implemented here (config accepts model / both once the reward-model stage exists)."""


def make_reward(name: str, *, tokenizer: Any, answers: Mapping[tuple[int, ...], str] | None = None) -> Reward:
    """The reward of ``rlhf.reward=name``."""
    if name == "verifier":
        return VerifierReward(tokenizer, answers)
    if name in ("model", "both"):
        raise ValueError(
            f"rlhf.reward={name}: needs the reward-model stage (a trained reward model), which this version "
            "does not have; use reward=verifier"
        )
    raise ValueError(f"rlhf.reward={name!r}: must be one of {list(REWARDS)}")
