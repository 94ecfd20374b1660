"""A stage part's result file (pipeline.schema.graph ``Stage.parts``: eval runs one job per model).

A part job writes its result under ``<stage dir>/parts/<name>.json`` atomically, with the stage's hash as its
identity; the stage's gathering job reads it back, and a re-run submits only the parts with no such file
(a part killed before its write left nothing, so it is redone). The stage decides what a result holds.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pipeline.records.files import atomic_write_text

FOLDER = "parts"


def part_file(out_dir: Path, part: str) -> Path:
    """``<out_dir>/parts/<name>.json``: the part's name made file-safe (``hf:/a/b`` -> ``hf_a_b-<hash>``)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", part).strip("_") or "part"
    if safe != part:  # two names that clean up alike keep apart
        safe += "-" + hashlib.sha256(part.encode()).hexdigest()[:8]
    return Path(out_dir) / FOLDER / f"{safe}.json"


def write_part(out_dir: Path, part: str, identity: str, result: dict[str, Any]) -> Path:
    path = part_file(out_dir, part)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"part": part, "identity": identity, "result": result}, indent=1))
    return path


def read_part(out_dir: Path, part: str, identity: str) -> dict[str, Any] | None:
    """The part's result when its file was written for ``identity`` (the stage's hash), else None."""
    path = part_file(out_dir, part)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if doc.get("part") != part or doc.get("identity") != identity:
        return None
    result: dict[str, Any] = doc.get("result") or {}
    return result
