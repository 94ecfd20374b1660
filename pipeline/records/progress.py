"""Progress lines drawn from a stage's metrics file (jobs write logs elsewhere; the submitter reads metrics)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_record(stage: str, rec: dict[str, Any]) -> str | None:
    """One human line for a metrics record, or None for records not worth a line."""
    kind = rec.get("kind")
    if kind == "train":
        parts = [
            f"[{stage}] step {rec.get('step')}/{rec.get('iters', '?')}",
            f"loss {rec.get('loss', float('nan')):.4f}",
        ]
        for key, label in (
            ("reward_margin", "margin"),
            ("pref_acc", "pref_acc"),
            ("reward_mean", "reward"),
            ("kl", "kl"),
        ):
            if key in rec:
                parts.append(f"{label} {rec[key]:.3f}")
        if "tokens_per_s" in rec:
            parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
        if isinstance(rec.get("mfu"), (int, float)):
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        mem = rec.get("mem_alloc_gb", rec.get("mem_rss_gb"))
        if isinstance(mem, (int, float)):
            parts.append(f"mem {mem:.2f} GiB" + (" RSS" if "mem_rss_gb" in rec else ""))
        parts.append(f"ETA {fmt_duration(rec.get('eta_s'))}")
        return "  ".join(parts)
    if kind == "valid":
        return f"[{stage}] step {rec.get('step')}  valid loss {rec.get('loss', float('nan')):.4f}  ppl {rec.get('ppl', float('nan')):.2f}"
    if kind == "alarm":
        return f"[{stage}] ALARM {rec.get('alarm')} at step {rec.get('step')}: {rec.get('message')}"
    if kind == "info" and "message" in rec:
        return f"[{stage}] {rec['message']}"
    return None


class Follower:
    """Prints new lines of a metrics.jsonl as they appear."""

    def __init__(self, stage: str, path: Path, out: TextIO = sys.stdout) -> None:
        self.stage = stage
        self.path = path
        self.out = out
        self.offset = 0
        self.start = time.time()
        self.announced = False

    def poll(self, final: bool = False) -> None:
        if not self.announced:
            print(f"[{self.stage}] started", file=self.out, flush=True)
            self.announced = True
        for rec in self._new_records():
            line = format_record(self.stage, rec)
            if line:
                print(line, file=self.out, flush=True)
        if final:
            print(
                f"[{self.stage}] done in {fmt_duration(time.time() - self.start)}", file=self.out, flush=True
            )

    def _new_records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # only whole lines; a line being written is read next time
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def last_record(path: Path, kind: str) -> dict[str, Any] | None:
    """The newest record of ``kind`` in a metrics file (reads its tail only)."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(f.tell() - 65536, 0))
        data = f.read()
    for line in reversed(data.splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind:
            return rec
    return None
