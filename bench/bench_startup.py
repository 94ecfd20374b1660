"""Start-up costs: the tiny graph end to end, split per stage, against the import floor of a training job.

    python -m bench.bench_startup [--reps 1] [-- extra overrides]

Runs ``python -m pipeline experiment=tiny`` (local executor: one process per stage, as on a cluster) in a
fresh run directory and prints, per stage, the wall time from submission to completion (ledger
``submitted_at`` -> ``ended_at``), the job's own time (``started_at`` -> ``ended_at``) and, for training
stages, the ``startup`` metrics record (job start -> first training step, and its parts). The baseline run in
the same script is the floor every training job pays: a fresh interpreter importing torch and megatron.core
(``import floor``); the ratio is each training stage's time to its first step over that floor. With
``--compile-baseline`` each repetition also runs the graph with torch.compile kept in the jobs (as before
``cpu_compat.skip_torch_compile``), interleaved, and the ratio of the end-to-end times is printed. With
``--fresh-baseline`` each repetition also runs it with ``cluster.prefork=false`` (a fresh interpreter per
rank, as before pipeline.submit.prefork), interleaved, and prints that ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("data_prep", "pretrain", "sft", "rlhf", "eval")


def import_floor() -> float:
    t = time.perf_counter()
    env = {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
    }  # as a CPU job imports it (cpu_compat.skip_torch_compile)
    subprocess.run([sys.executable, "-c", "import torch, megatron.core"], check=True, cwd=ROOT, env=env)
    return time.perf_counter() - t


def one_run(overrides: list[str], env: dict[str, str] | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        t, t_epoch = time.perf_counter(), time.time()
        cmd = [sys.executable, "-m", "pipeline", "experiment=tiny", f"run.root={tmp}", *overrides]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, env=env)
        total, end_epoch = time.perf_counter() - t, time.time()
        (run_dir,) = [p for p in Path(tmp).iterdir() if p.is_dir() and not p.name.startswith(".")]
        out: dict = {"total_s": total, "stages": {}}
        ledgers = [json.loads((run_dir / "ledger" / f"{s}.json").read_text()) for s in STAGES]
        out["before_first_stage_s"] = ledgers[0]["submitted_at"] - t_epoch
        out["after_last_stage_s"] = end_epoch - ledgers[-1]["ended_at"]
        out["between_stages_s"] = sum(b["submitted_at"] - a["ended_at"] for a, b in zip(ledgers, ledgers[1:]))
        for stage in STAGES:
            rec = json.loads((run_dir / "ledger" / f"{stage}.json").read_text())
            row = {
                "wall_s": rec["ended_at"] - rec["submitted_at"],
                "job_s": rec["ended_at"] - rec["started_at"],
            }
            metrics = run_dir / "stages" / stage / "metrics.jsonl"
            if metrics.is_file():
                for line in metrics.read_text().splitlines():
                    m = json.loads(line)
                    if m.get("kind") == "startup":
                        row["startup"] = m
            out["stages"][stage] = row
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument(
        "--compile-baseline",
        action="store_true",
        help="also run each repetition with TORCHDYNAMO_DISABLE=0 (torch.compile kept, as before) and print the ratio",
    )
    p.add_argument(
        "--fresh-baseline",
        action="store_true",
        help="also run each repetition with cluster.prefork=false (a fresh interpreter per rank) and print the ratio",
    )
    p.add_argument("overrides", nargs="*", help="extra pipeline overrides")
    args = p.parse_args(argv)
    floors, runs, baseline, fresh = [], [], [], []
    for _ in range(args.reps):
        floors.append(import_floor())
        runs.append(one_run(args.overrides))
        if args.compile_baseline:
            baseline.append(one_run(args.overrides, {**os.environ, "TORCHDYNAMO_DISABLE": "0"}))
        if args.fresh_baseline:
            fresh.append(one_run([*args.overrides, "cluster.prefork=false"]))
    floor = statistics.median(floors)
    total = statistics.median(r["total_s"] for r in runs)
    print(f"experiment=tiny end to end: {total:.1f} s (median of {args.reps}); import floor {floor:.2f} s")
    for key in ("before_first_stage_s", "between_stages_s", "after_last_stage_s"):
        print(f"  {key[:-2].replace('_', ' '):<30} {statistics.median(r[key] for r in runs):6.2f} s")
    for stage in STAGES:
        rows = [r["stages"][stage] for r in runs]
        wall = statistics.median(r["wall_s"] for r in rows)
        job = statistics.median(r["job_s"] for r in rows)
        line = f"  {stage:<10} {wall:6.1f} s submitted -> done, {job:6.1f} s in its job"
        starts = [r["startup"] for r in rows if "startup" in r]
        if starts:
            s = {k: statistics.median(x[k] for x in starts) for k in starts[0] if k.endswith("_s")}
            parts = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in s.items() if k != "to_first_step_s")
            line += (
                f"; job start -> first step {s['to_first_step_s']:.2f} s "
                f"({s['to_first_step_s'] / floor:.2f}x the import floor; {parts})"
            )
        print(line)
    if fresh:
        before = statistics.median(r["total_s"] for r in fresh)
        print(
            f"with a fresh interpreter per rank (cluster.prefork=false): {before:.1f} s; "
            f"ratio prefork / fresh {total / before:.2f}"
        )
    if baseline:
        before = statistics.median(r["total_s"] for r in baseline)
        print(
            f"with torch.compile kept (TORCHDYNAMO_DISABLE=0): {before:.1f} s; ratio now / then {total / before:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
