"""The generated, program-checkable tasks used for SFT, RLHF and eval: counting (the default) and arithmetic.

``counting``: "What comes after 47?" -> "48". ``arithmetic``: a problem is ``a + b`` or ``a - b`` (with ``a >= b``, so answers are never negative), operands drawn
uniformly from ``[0, max_operand]``. The prompt is ``"What is 23 + 45?"`` and the answer is the plain
decimal ``"68"``; the tokenizer splits digits one per token, so the model writes answers digit by digit.

How hard each setting is for the default model: docs/demo.md. The task code works for any ``max_operand``.

Held-out prompts (``eval_task.jsonl``, ``eval_pref.jsonl``) never appear in any training file: they
are drawn first, and every training problem is drawn from the rest of the problem space.

Noisy demonstrations (``data.sft_noise``, :func:`noisy_sft_records`): the embedded default trains SFT on
demonstrations from a demonstrator with a systematic slip on half of the problems (counting: odd numbers
answered with the number itself), 70% of the time. Greedy SFT then learns the slip as the answer there
(held-out accuracy ~0.57 instead of ~0.96) while about a quarter of its samples still hold the right answer,
which is what RL with this module's checker as reward finds and reinforces (README "What you should see").
Preference pairs, RL prompts (``rl_train.jsonl``) and eval sets always carry the right answers.

Rejected answers for preference pairs are near misses a weak model could plausibly produce
(:func:`near_misses`): off by one, off by ten, two adjacent digits swapped, the carry (or borrow)
dropped. Everything here is deterministic given the seed (numpy PCG64).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

OPS: tuple[str, ...] = ("+", "-")
"""Operations of the ``arithmetic`` task, drawn with equal probability."""
TASKS: dict[str, tuple[str, ...]] = {"arithmetic": OPS, "counting": ("after",)}
"""Each task and its operations. ``counting``: "What comes after 47?" -> "48" (the successor, with carries)."""

MISS_KINDS: tuple[str, ...] = ("off_by_one", "off_by_ten", "swapped_digits", "carry_dropped")
"""Kinds of near-miss wrong answers used as DPO rejections."""

_PROMPT_RE = re.compile(r"^What is (\d+) ([+-]) (\d+)\?$")
_AFTER_RE = re.compile(r"^What comes after (\d+)\?$")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem."""

    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        if self.op == "after":
            return f"What comes after {self.a}?"
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def value(self) -> int:
        return self.a - self.b if self.op == "-" else self.a + self.b  # "after": b == 1

    @property
    def answer(self) -> str:
        return str(self.value)

    def as_text(self) -> str:
        """The problem as one line of plain pretraining text."""
        return f"{self.prompt} {self.answer}"


def parse_prompt(prompt: str) -> Problem:
    """Inverse of ``Problem.prompt`` (ValueError if ``prompt`` is not a task prompt)."""
    after = _AFTER_RE.match(prompt.strip())
    if after:
        return Problem(int(after.group(1)), "after", 1)
    m = _PROMPT_RE.match(prompt.strip())
    if not m:
        raise ValueError(f"not a task prompt: {prompt!r}")
    return Problem(int(m.group(1)), m.group(2), int(m.group(3)))


def is_correct(answer_text: str, expected: str | int) -> bool:
    """Exact match of a generated answer: surrounding whitespace and one trailing period are ignored."""
    text = answer_text.strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text == str(int(expected))


def space_size(max_operand: int, task: str = "arithmetic") -> int:
    """Distinct prompts: (n+1)^2 additions plus (n+1)(n+2)/2 subtractions with a >= b; counting: n+1."""
    n = max_operand + 1
    if task == "counting":
        return n
    return n * n * ("+" in OPS) + (n * (n + 1) // 2) * ("-" in OPS)


def random_problem(rng: np.random.Generator, max_operand: int, task: str = "arithmetic") -> Problem:
    if task == "counting":
        return Problem(int(rng.integers(0, max_operand + 1)), "after", 1)
    op = OPS[int(rng.integers(len(OPS)))]
    # two scalar draws: the same stream as one draw of size 2, at half the cost (no array to build)
    a, b = int(rng.integers(0, max_operand + 1)), int(rng.integers(0, max_operand + 1))
    if op == "-" and a < b:
        a, b = b, a
    return Problem(a, op, b)


@dataclass
class TaskSplit:
    """Held-out problems and a sampler for training problems that never returns a held-out prompt."""

    held_out: list[Problem]
    max_operand: int
    task: str = "arithmetic"

    def __post_init__(self) -> None:
        self._held = {p.prompt for p in self.held_out}

    def train_problems(self, n: int, rng: np.random.Generator) -> list[Problem]:
        """``n`` training problems (with repeats when the space is small), none of them held out."""
        out: list[Problem] = []
        while len(out) < n:
            p = random_problem(rng, self.max_operand, self.task)
            if p.prompt not in self._held:
                out.append(p)
        return out


def make_split(
    num_held_out: int, max_operand: int, rng: np.random.Generator, task: str = "arithmetic"
) -> TaskSplit:
    """Draw ``num_held_out`` distinct held-out problems, at most a quarter of the problem space."""
    n = min(num_held_out, space_size(max_operand, task) // 4)
    seen: dict[str, Problem] = {}
    while len(seen) < n:
        p = random_problem(rng, max_operand, task)
        seen.setdefault(p.prompt, p)
    return TaskSplit(held_out=list(seen.values()), max_operand=max_operand, task=task)


# ---------------------------------------------------------------------------- near misses


def _carry_dropped(p: Problem) -> int:
    """Digit-wise result without carries (addition) or borrows (subtraction)."""
    a, b = str(p.a), str(p.b)
    width = max(len(a), len(b))
    a, b = a.rjust(width, "0"), b.rjust(width, "0")
    digits = [
        (int(x) - int(y)) % 10 if p.op == "-" else (int(x) + int(y)) % 10 for x, y in zip(a, b, strict=True)
    ]
    return int("".join(map(str, digits)))


def near_misses(p: Problem) -> dict[str, int]:
    """Every applicable near-miss kind and its wrong value (never the right one, never negative)."""
    v = p.value
    out: dict[str, int] = {
        "off_by_one": v + 1 if v == 0 else v - 1,
        "off_by_ten": v + 10 if v < 10 else v - 10,
    }
    s = str(v)
    swaps = [
        int(s[:i] + s[i + 1] + s[i] + s[i + 2 :])
        for i in range(len(s) - 1)
        if s[i] != s[i + 1] and not (i == 0 and s[1] == "0")
    ]
    if swaps:
        out["swapped_digits"] = swaps[0]
    cd = _carry_dropped(p)
    if cd != v:
        out["carry_dropped"] = cd
    return out


def near_miss(p: Problem, rng: np.random.Generator) -> tuple[str, str]:
    """A (kind, wrong answer text) pair, the kind chosen uniformly among the applicable ones."""
    options = near_misses(p)
    kinds = [k for k in MISS_KINDS if k in options]
    kind = kinds[int(rng.integers(len(kinds)))]
    return kind, str(options[kind])


def miss_kind(p: Problem, wrong: str) -> str | None:
    """Which near-miss kind ``wrong`` is for ``p`` (None if it is not a near miss)."""
    for kind, value in near_misses(p).items():
        if str(value) == wrong.strip():
            return kind
    return None


# ---------------------------------------------------------------------------- records


def sft_record(p: Problem) -> dict[str, str]:
    return {"prompt": p.prompt, "response": p.answer}


def systematic_error(p: Problem) -> str | None:
    """The wrong answer a noisy demonstrator writes for ``p``, or None if ``p`` is outside the noisy class.

    The noisy class is about half of the problems, and the error is one fixed near miss per problem, so a
    model trained on the noisy demonstrations learns it as the most likely answer there:

    - ``counting``: odd numbers; the demonstrator writes the number itself ("What comes after 47?" -> "47",
      the fencepost slip), so correct and wrong answers differ only in the last digit.
    - ``arithmetic``: problems with a carry (addition) or a borrow (subtraction); the carry is dropped
      ("What is 27 + 15?" -> "32").
    """
    if p.op == "after":
        return str(p.a) if p.a % 2 == 1 else None
    wrong = _carry_dropped(p)
    return None if wrong == p.value else str(wrong)


def noisy_sft_records(
    problems: list[Problem], noise: float, rng: np.random.Generator
) -> tuple[list[dict[str, str]], int]:
    """SFT records where each problem of the noisy class gets :func:`systematic_error`'s answer with
    probability ``noise`` (the rest stay correct); returns the records and how many are wrong.

    With ``noise > 0.5`` greedy decoding of the SFT model picks the wrong answer on the noisy class while the
    right one keeps about ``1 - noise`` of the sampled answers: a verifier reward (RL) can find and
    reinforce it, imitation of the same data cannot. One draw per problem, in order, whatever the class,
    so the records depend only on the seed and ``noise``.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise={noise}: must be in [0, 1]")
    draws = rng.random(len(problems))
    records, wrong = [], 0
    for p, u in zip(problems, draws, strict=True):
        error = systematic_error(p)
        if error is not None and u < noise:
            records.append({"prompt": p.prompt, "response": error})
            wrong += 1
        else:
            records.append(sft_record(p))
    return records, wrong


def pref_record(p: Problem, rng: np.random.Generator) -> dict[str, str]:
    _, wrong = near_miss(p, rng)
    return {"prompt": p.prompt, "chosen": p.answer, "rejected": wrong}


def eval_record(p: Problem) -> dict[str, str]:
    return {"prompt": p.prompt, "answer": p.answer}


def text_document(problems: list[Problem]) -> str:
    """Several problems as a plain-text pretraining document, one per line."""
    return "\n".join(p.as_text() for p in problems)
