"""Finding the newest checkpoint of a root that verifies (``find_latest``); incomplete and corrupt ones are skipped."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.checkpoint.collective import on_rank0
from engine.checkpoint.integrity import verify, verify_collective, verify_mode
from engine.checkpoint.layout import LATEST, iter_dirs
from engine.runtime.distributed import rank as _rank
from engine.runtime.distributed import world_size as _world

log = logging.getLogger(__name__)


def find_latest(
    ckpt_root: Path, *, collective: bool = True, mode: str | None = None, below: int | None = None
) -> Path | None:
    """The newest checkpoint under ``ckpt_root`` that verifies, or None.

    Incomplete saves (temp directories, no marker) and corrupt checkpoints are logged as warnings, naming
    the file and the fault, and skipped; nothing is deleted. With ``collective`` and an initialized
    process group (call it on all ranks), every rank checks its share of each candidate's files
    (``verify_collective``) and all ranks get the same answer. ``mode``: ``VERIFY_MODES`` (default: the
    process's ``set_verify_mode``, ``full`` unless changed). ``below``: only iterations below it.
    """
    ckpt_root, mode = Path(ckpt_root), mode or verify_mode()
    if not (collective and _world() > 1):
        found = _find_latest_here(ckpt_root, mode, below)
        return Path(found) if found else None
    names = on_rank0(lambda: _candidates(ckpt_root, below), f"listing {ckpt_root}")
    for name in names:
        path = ckpt_root / name
        problems = verify_collective(path, mode)
        if not problems:
            if _rank() == 0:
                _check_latest_pointer(ckpt_root, path)
            return path
        if _rank() == 0:
            log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def _candidates(ckpt_root: Path, below: int | None = None) -> list[str]:
    """Names of the committed-looking checkpoints (iterations below ``below``), newest first; warns about
    unfinished saves."""
    for tmp in sorted(ckpt_root.glob("tmp.iter_*")):
        log.warning("incomplete checkpoint %s: the save did not finish; ignored, kept for inspection", tmp)
    return [path.name for it, path in iter_dirs(ckpt_root) if below is None or it < below]


def _find_latest_here(ckpt_root: Path, mode: str = "full", below: int | None = None) -> str | None:
    for name in _candidates(ckpt_root, below):
        path = ckpt_root / name
        problems = verify(path, mode=mode)
        if not problems:
            _check_latest_pointer(ckpt_root, path)
            return str(path)
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def _check_latest_pointer(ckpt_root: Path, found: Path) -> None:
    try:
        named = (ckpt_root / LATEST).read_text().strip()
    except OSError:
        named = None
    if named != found.name:
        log.warning("%s names %r but the newest verified checkpoint is %s", ckpt_root / LATEST, named, found)
