"""Rewards for online RL: a callable ``reward(prompts, responses) -> np.ndarray`` (float32, one per response).

``prompts`` and ``responses`` are token-id lists of equal count: the prompt as the model saw it
(``<|user|>...<|assistant|>``) and the sampled response (the closing eod not included). Every rank calls
the reward with the same rollouts and must get the same values (deterministic, no per-rank state).

Sources (``rlhf.reward``; ``make_reward``):
- ``verifier``: the task checker (the stage passes ``stages.tasks.is_correct`` and each prompt's right
  answer; the engine never imports the task): 1.0 for the right answer, else 0.0.
- ``model`` / ``both``: a trained reward model, added with the reward-model stage (not in this version).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class Reward(Protocol):
    def __call__(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> np.ndarray: ...


class VerifierReward:
    """1.0 when ``check(decoded response, expected answer)`` holds, else 0.0 (a response holding a special
    token is never right). ``answers``: each prompt's token ids -> its right answer."""

    def __init__(
        self, tokenizer: Any, answers: Mapping[tuple[int, ...], str], check: Callable[[str, str], bool]
    ) -> None:
        self.tokenizer = tokenizer
        self.answers = dict(answers)
        self.check = check

    def expected(self, prompt: Sequence[int]) -> str:
        key = tuple(int(t) for t in prompt)
        if key not in self.answers:
            raise KeyError(f"reward: no right answer known for prompt {self.tokenizer.decode(key)!r}")
        return self.answers[key]

    def __call__(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> np.ndarray:
        if len(prompts) != len(responses):
            raise ValueError(f"reward: {len(prompts)} prompts but {len(responses)} responses")
        special = set(self.tokenizer.special_ids.values())
        out = np.zeros(len(prompts), dtype=np.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if any(int(t) in special for t in r):
                continue
            out[i] = float(self.check(self.tokenizer.decode(r), self.expected(p)))
        return out


REWARDS = ("verifier",)
"""Reward sources implemented here (config accepts model / both once the reward-model stage exists)."""


def make_reward(
    name: str,
    *,
    tokenizer: Any,
    answers: Mapping[tuple[int, ...], str],
    check: Callable[[str, str], bool],
) -> Reward:
    """The reward of ``rlhf.reward=name``: ``answers`` and ``check`` feed the verifier."""
    if name == "verifier":
        return VerifierReward(tokenizer, answers, check)
    if name in ("model", "both"):
        raise ValueError(
            f"rlhf.reward={name}: needs the reward-model stage (a trained reward model), which this version "
            "does not have; use reward=verifier"
        )
    raise ValueError(f"rlhf.reward={name!r}: must be one of {list(REWARDS)}")
