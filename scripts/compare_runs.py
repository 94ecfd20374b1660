"""Compare two run directories of the same config: are they the same run, bit for bit?

    python scripts/compare_runs.py RUN_A RUN_B      (exit 0: identical; 1: differences, listed)

Per stage: the final checkpoint's files byte for byte (the dist-checkpoint shards, common.pt, the RNG
states), its ``.metadata`` index by content (it also holds a random save id), data_prep's files by the
sha256 its manifest records, the train/valid lines of metrics.jsonl without timings, eval's results.json
without paths, and exported safetensors byte for byte. Used to prove that a change which should not change behaviour (a restructuring) did not:
run the same command on two checkouts, then compare.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

MACHINE = ("time", "tflops", "mfu")
"""Metric keys that measure the machine, not the run (with every key ending in _s or _gb: times, rates, memory)."""


def final_checkpoint(stage_dir: Path) -> Path | None:
    latest = stage_dir / "checkpoints" / "latest"
    return stage_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None


def _index(path: Path) -> Any:
    meta = pickle.loads(path.read_bytes())  # torch's own format; both sides are runs you made
    return {k: repr(v) for k, v in sorted(meta.state_dict_metadata.items())}


def compare_checkpoints(a: Path, b: Path) -> list[str]:
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    diffs = []
    for name in names:
        if name == "COMPLETE.json":
            continue  # checksums and a timestamp: the files it lists are compared themselves
        fa, fb = a / name, b / name
        if not (fa.is_file() and fb.is_file()):
            diffs.append(f"{name}: only in {'A' if fa.is_file() else 'B'}")
        elif name == ".metadata":
            if _index(fa) != _index(fb):
                diffs.append(".metadata: the tensor index differs")
        elif fa.read_bytes() != fb.read_bytes():
            diffs.append(f"{name}: bytes differ")
    return diffs


def _metric_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {k: v for k, v in row.items() if k not in MACHINE and not k.endswith(("_s", "_gb"))}
        for row in lines
        if row.get("kind") in ("train", "valid")
    ]


def _without_paths(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in ("dir", "checkpoint")}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


def compare_stage(name: str, a: Path, b: Path) -> list[str]:
    diffs: list[str] = []
    ca, cb = final_checkpoint(a), final_checkpoint(b)
    if (ca is None) != (cb is None) or (ca and cb and ca.name != cb.name):
        diffs.append(f"final checkpoint: {ca and ca.name} vs {cb and cb.name}")
    elif ca and cb:
        diffs += [f"{ca.name}/{d}" for d in compare_checkpoints(ca, cb)]
    if _metric_lines(a / "metrics.jsonl") != _metric_lines(b / "metrics.jsonl"):
        diffs.append("metrics.jsonl: train/valid lines differ")
    if (a / "manifest.json").is_file():
        sha_a, sha_b = (
            {f: e.get("sha256") for f, e in json.loads((d / "manifest.json").read_text())["files"].items()}
            for d in (a, b)
        )
        diffs += [
            f"{f}: sha256 differs" for f in sorted(set(sha_a) | set(sha_b)) if sha_a.get(f) != sha_b.get(f)
        ]
    for fa in sorted(a.rglob("*.safetensors")):  # exported Hugging Face weights
        fb = b / fa.relative_to(a)
        if not fb.is_file() or fa.read_bytes() != fb.read_bytes():
            diffs.append(f"{fa.relative_to(a)}: {'bytes differ' if fb.is_file() else 'only in A'}")
    if (a / "results.json").is_file():
        ra, rb = (_without_paths(json.loads((d / "results.json").read_text())) for d in (a, b))
        if ra != rb:
            diffs.append("results.json: results differ")
    return [f"{name}: {d}" for d in diffs]


def compare_runs(a: Path, b: Path) -> tuple[list[str], list[str]]:
    """(stages compared, differences) of two run directories."""
    stages = sorted({p.name for p in (a / "stages").iterdir()} | {p.name for p in (b / "stages").iterdir()})
    diffs: list[str] = []
    for s in stages:
        sa, sb = a / "stages" / s, b / "stages" / s
        if not (sa.is_dir() and sb.is_dir()):
            diffs.append(f"{s}: only in {'A' if sa.is_dir() else 'B'}")
            continue
        diffs += compare_stage(s, sa, sb)
    return stages, diffs


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (Path(p) for p in argv)
    stages, diffs = compare_runs(a, b)
    for s in stages:
        ck = final_checkpoint(a / "stages" / s)
        mark = "DIFFERENT" if any(d.startswith(f"{s}:") for d in diffs) else "identical"
        print(f"{s:<13} {mark:<10} {'final checkpoint ' + ck.name if ck else ''}")
    for d in diffs:
        print(f"  {d}")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
