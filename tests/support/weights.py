"""A run's final pretrain weights and their bit-for-bit comparison, for the exact-resume tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.cli import run_dir

if TYPE_CHECKING:
    import torch


def final_tensors(root: Path, step: int = 6) -> dict[str, torch.Tensor]:
    """The tensors of the newest pretrain checkpoint under run root ``root``'s one run (see ``tensors_at``)."""
    return tensors_at(run_dir(root), step)


def tensors_at(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The tensors of the newest pretrain checkpoint of run directory ``run``, which must be the one of ``step``."""
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load_tensors

    latest = find_latest(run / "stages" / "pretrain" / "checkpoints", collective=False)
    assert latest is not None and latest.name == f"iter_{step:07d}", latest
    return load_tensors(latest)


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    import torch

    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"tensors differ: {diff[:5]}"
