"""The files of a checkpoint root: names, the completion marker, listing.

Layout of ``ckpt_root`` (a stage's ``checkpoints/``)::

    iter_0000100/                 committed: megatron dist_checkpointing files (torch_dist backend),
        COMPLETE.json             one RNG file per rank, and the marker listing every file (size, xxh3_128)
    tmp.iter_0000150.<nonce>/     a save in progress, or one that crashed: never read, never deleted here
    latest                        the name of the newest committed checkpoint, written last

Readers trust only directories whose marker verifies (engine.checkpoint.integrity); ``find_latest``
(engine.checkpoint.latest) skips and reports the rest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from engine.checkpoint.errors import CheckpointError
from pipeline.records.files import atomic_write_text as _write_atomic

MARKER = "COMPLETE.json"
LATEST = "latest"
FORMAT_VERSION = 1

ITER_DIR = re.compile(r"^iter_(\d{7})$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$|^rng\.rank(\d+)\.pt$")


def iter_dir_name(iteration: int) -> str:
    """``iter_0000100`` for iteration 100."""
    return f"iter_{iteration:07d}"


def owner(name: str) -> int:
    """The rank that writes a checkpoint file: ``__<rank>_<n>.distcp``, ``rng.rank<rank>.pt``, else 0."""
    m = _RANK_FILE.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def iter_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of every ``iter_<7 digits>`` directory, newest first."""
    found = []
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else ():
        m = ITER_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def read_marker(path: Path) -> dict[str, Any]:
    """The parsed marker of checkpoint ``path``; raises CheckpointError naming the file and the fault."""
    marker = path / MARKER
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{marker}: missing (the save did not complete)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker}: unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{marker}: no 'files' table")
    return meta


def write_marker(directory: Path, meta: dict[str, Any]) -> None:
    _write_atomic(directory / MARKER, json.dumps(meta, indent=1, sort_keys=True) + "\n")
