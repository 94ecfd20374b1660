"""Per-rank RNG states (python, numpy, torch, CUDA, megatron's tracker): saved as ``rng.rank<rank>.pt``,
restored only when the parallel layout is unchanged."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint.unpickle import load_plain
from engine.runtime.distributed import rank as _rank
from engine.runtime.distributed import world_size as _world

log = logging.getLogger(__name__)


def rng_file(rank: int) -> str:
    """The name of rank ``rank``'s RNG file in a checkpoint."""
    return f"rng.rank{rank}.pt"


def parallel_layout() -> dict[str, int]:
    """World size and, when megatron's model parallel state is up, the TP/PP/DP sizes."""
    layout = {"world": _world()}
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return layout
    if ps.model_parallel_is_initialized():
        layout |= {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
        }
    return layout


def _tracker() -> Any:
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker()


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as tensors and plain values only: the file loads with ``weights_only=True``."""
    tracker = _tracker()
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    return {
        "layout": parallel_layout(),
        "python": {
            "version": py_version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in tracker.get_states().items()} if tracker else None,
    }


def restore_rng(path: Path) -> None:
    """Restore this rank's RNG states from checkpoint ``path`` (a warning, and nothing restored, when its
    file is missing or the layout differs)."""
    file = path / rng_file(_rank())
    if not file.is_file():
        log.warning("%s: missing; RNG states not restored", file)
        return
    saved = load_plain(file)
    if saved["layout"] != parallel_layout():
        log.warning(
            "%s: saved under layout %s, now %s; RNG states not restored",
            file,
            saved["layout"],
            parallel_layout(),
        )
        return
    set_rng_state(saved)


def set_rng_state(saved: dict[str, Any]) -> None:
    """Set this rank's RNG states to ``saved`` (what :func:`rng_state` returned)."""
    py, npy = saved["python"], saved["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state(
        (
            npy["name"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    tracker = _tracker()
    if saved["tracker"] and tracker is not None:
        tracker.set_states(saved["tracker"])
