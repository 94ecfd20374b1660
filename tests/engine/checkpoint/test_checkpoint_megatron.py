"""Exact resume through engine.checkpoint (save, load, manager) with a real tiny megatron GPT, optimizer and schedule.

Run A trains 4 steps and saves at steps 2 and 4; run B gets a copy of A's checkpoints without step 4,
resumes from step 2 and trains to 4. Required: B's model and optimizer right after loading equal A's at its
step-2 save bit for bit, B's losses/grad norms/lrs of steps 3-4 equal A's, and B's state at its step-4 save
equals A's. Every run is a fresh process group in subprocesses (tests/support/resume_drill.py is the
worker), built with the engine's own distributed init, model, optimizer and trainer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.resume_drill import (
    MODEL,
    MODEL_DROPOUT,
    assert_exact_resume,
    differing_tensors,
    launch,
    run_pair,
)

# ---------------------------------------------------------------------------- tests


def test_exact_resume_one_rank(tmp_path: Path) -> None:
    spec = {"model": MODEL_DROPOUT, "parallel": {"global_batch_size": 8, "micro_batch_size": 4}}
    a, b, a_dump, b_dump = run_pair(tmp_path, 1, spec)
    assert_exact_resume(a, b, a_dump, b_dump, world=1)
    print(f"\n1 rank: save {a['save_s']} s, load {b['load_s']} s")

    # init_from: a fresh run takes A's final weights, with a fresh optimizer and schedule.
    c_dump = tmp_path / "c" / "dump"
    init = {
        "root": str(tmp_path / "c" / "checkpoints"),
        "dump": str(c_dump),
        "init_from": str(a_dump.parent / "checkpoints"),
    }
    c = launch(1, {**spec, **init}, tmp_path / "c")
    assert c["resumed_from"] == 0
    differ = differing_tensors(a_dump / "save4.rank0.pt", c_dump / "loaded.rank0.pt")
    assert differ and not [k for k in differ if k.startswith("model")], differ


def test_exact_resume_from_an_async_save(tmp_path: Path) -> None:
    """Step 2 is saved asynchronously while step 3 trains (the step-4 save, final, is synchronous)."""
    par = {"global_batch_size": 8, "micro_batch_size": 4}
    a, b, a_dump, b_dump = run_pair(
        tmp_path, 1, {"model": MODEL_DROPOUT, "parallel": par, "async_save": True}
    )
    assert_exact_resume(a, b, a_dump, b_dump, world=1)
    print(f"\n1 rank, async: save call {a['save_s']} s")


@pytest.mark.dist
def test_exact_resume_distributed_optimizer_two_ranks(tmp_path: Path) -> None:
    par = {"global_batch_size": 8, "micro_batch_size": 2, "distributed_optimizer": True}
    a, b, a_dump, b_dump = run_pair(tmp_path, 2, {"model": MODEL, "parallel": par})
    assert a["optim_fix"] is True
    assert_exact_resume(a, b, a_dump, b_dump, world=2)
    print(f"\n2 ranks, distributed optimizer: save {a['save_s']} s, load {b['load_s']} s")

    # Resharding: the DP2 checkpoint loads on one rank (DP1); weights equal A's, training goes on.
    c_root = tmp_path / "c" / "checkpoints"
    shutil.copytree(tmp_path / "a" / "checkpoints", c_root, ignore=shutil.ignore_patterns("iter_0000004"))
    c = launch(
        1,
        {"model": MODEL, "parallel": par, "root": str(c_root), "dump": str(tmp_path / "c" / "dump")},
        tmp_path / "c",
    )
    assert c["resumed_from"] == 2
    for step_a, step_c in zip(a["history"][2:], c["history"]):
        assert step_c["loss"] == pytest.approx(step_a["loss"], rel=1e-5)
