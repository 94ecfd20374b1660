"""The arithmetic task: answers, checker, near misses, held-out split, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from stages import tasks


def test_problem_text_and_answer() -> None:
    p = tasks.Problem(23, "+", 45)
    assert (p.prompt, p.answer, p.as_text()) == ("What is 23 + 45?", "68", "What is 23 + 45? 68")
    assert tasks.parse_prompt("What is 52 - 17?") == tasks.Problem(52, "-", 17)
    rng = np.random.default_rng(0)
    for _ in range(200):
        q = tasks.random_problem(rng, 20)
        assert q.value >= 0 and max(q.a, q.b) <= 20 and tasks.parse_prompt(q.prompt) == q


def test_is_correct() -> None:
    assert tasks.is_correct("68", "68") and tasks.is_correct(" 68 ", 68) and tasks.is_correct("68.", "68")
    assert not tasks.is_correct("6 8", "68") and not tasks.is_correct("68 apples", "68")
    assert not tasks.is_correct("", "0") and not tasks.is_correct("086", "86")


def test_near_misses_are_wrong_plausible_and_labelled() -> None:
    assert tasks.near_misses(tasks.Problem(58, "+", 67)) == {
        "off_by_one": 124,
        "off_by_ten": 115,
        "swapped_digits": 215,
        "carry_dropped": 15,
    }
    assert tasks.near_misses(tasks.Problem(52, "-", 17))["carry_dropped"] == 45  # borrow dropped
    rng = np.random.default_rng(1)
    kinds = set()
    for _ in range(500):
        p = tasks.random_problem(rng, 99)
        kind, wrong = tasks.near_miss(p, rng)
        kinds.add(kind)
        assert wrong != p.answer and int(wrong) >= 0
        assert wrong == "0" or not wrong.startswith("0")
        assert abs(int(wrong) - p.value) <= max(10, 9 * 10 ** (len(p.answer) - 1))
        assert tasks.miss_kind(p, wrong) is not None
    assert kinds == set(tasks.MISS_KINDS)


def test_held_out_split_is_deterministic_and_disjoint() -> None:
    a = tasks.make_split(50, 30, np.random.default_rng(7))
    b = tasks.make_split(50, 30, np.random.default_rng(7))
    assert a.held_out == b.held_out and len({p.prompt for p in a.held_out}) == 50
    train = a.train_problems(2000, np.random.default_rng(8))
    assert not {p.prompt for p in train} & {p.prompt for p in a.held_out}
    small = tasks.make_split(200, 9, np.random.default_rng(0))
    assert len(small.held_out) == tasks.space_size(9) // 4


def test_counting_task() -> None:
    p = tasks.parse_prompt("What comes after 499?")
    assert p == tasks.Problem(499, "after", 1) and p.answer == "500" and p.prompt == "What comes after 499?"
    assert tasks.near_misses(p)["carry_dropped"] == 490
    split = tasks.make_split(40, 999, np.random.default_rng(3), "counting")
    held = {q.prompt for q in split.held_out}
    assert len(held) == 40 and all(q.op == "after" for q in split.held_out)
    train = split.train_problems(500, np.random.default_rng(4))
    assert not held & {q.prompt for q in train}
    assert tasks.space_size(999, "counting") == 1000


def test_noisy_demonstrations_are_systematic_on_their_class_only() -> None:
    problems = [tasks.Problem(n, "after", 1) for n in range(2000)]
    records, wrong = tasks.noisy_sft_records(problems, 0.7, np.random.default_rng(0))
    bad = [(p, r) for p, r in zip(problems, records) if r["response"] != p.answer]
    assert len(bad) == wrong and all(p.a % 2 == 1 and r["response"] == str(p.a) for p, r in bad)
    assert 0.65 < wrong / 1000 < 0.75  # 1000 odd numbers, 70% of them wrong
    assert tasks.noisy_sft_records(problems, 0.0, np.random.default_rng(0))[1] == 0
    assert records == tasks.noisy_sft_records(problems, 0.7, np.random.default_rng(0))[0]
    assert tasks.systematic_error(tasks.Problem(27, "+", 15)) == "32"  # arithmetic: the carry dropped
    assert tasks.systematic_error(tasks.Problem(21, "+", 15)) is None  # no carry: never noisy
    with pytest.raises(ValueError, match="noise=1.5"):
        tasks.noisy_sft_records(problems, 1.5, np.random.default_rng(0))
