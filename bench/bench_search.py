"""An ASHA search against the same points as a grid run to completion, on the tiny model, in one script.

    python -m bench.bench_search [--lrs 1e-3,3e-3,6e-3,1e-2] [--warmups 1,2,4,8] [--iters 24] [--concurrent 2]
                                 [--min-resource N] [--threads N]

Grid: ``python -m pipeline -m pretrain.lr=<lrs> pretrain.warmup_iters=<warmups>`` (today's sweep: every point to
the end, one after another). Search: the same points as ``choice(...)`` keys, ``search.sampler=grid`` (each
point once), ``search.pruner=asha``, ``search.n_trials`` = the number of points, ``search.max_concurrent`` trials
in flight. Prints, search / grid: the training steps run (compute, independent of the machine's load), the
CPU-seconds used (the machine's busy CPU time while each ran: run it on an otherwise idle machine), the
slot-seconds (each trial's wall time in its slot), the best final valid loss of each (and their gap), and the
search's idle slot share (1 - busy slot-seconds / (slots x its span from first submission to last end)).
Threads: the grid's stages run at their default, the search's local trials at cores // concurrent
(pipeline.search.controller.thread_caps); ``--threads N`` sets ``pretrain.threads=N`` for both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.records.ledger import Ledger, read_metrics
from pipeline.search import trials
from pipeline.search.launch import controller_alive
from pipeline.search.study import load_study

ROOT = Path(__file__).resolve().parents[1]


def base(iters: int, threads: int | None) -> list[str]:
    return [
        *([f"pretrain.threads={threads}"] if threads else []),
        "experiment=tiny",
        "run.stages=[data_prep,pretrain]",
        f"pretrain.iters={iters}",
        f"pretrain.save_interval={iters}",
        "pretrain.eval_interval=4",
        "pretrain.eval_iters=1",
        "pretrain.min_lr=0",
    ]


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (every process: the detached controller and jobs too)."""
    import psutil

    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def steps_and_loss(run_dir: Path) -> tuple[int, float | None]:
    recs = read_metrics(run_dir, "pretrain")
    steps = max((int(r["step"]) for r in recs if r.get("kind") == "train"), default=0)
    valid = [float(r["loss"]) for r in recs if r.get("kind") == "valid"]
    return steps, (valid[-1] if valid else None)


def run_grid(root: Path, a: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "pipeline", "-m", *base(a.iters, a.threads), f"run.root={root}"]
    cmd += [f"pretrain.lr={a.lrs}", f"pretrain.warmup_iters={a.warmups}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    steps, slot, best = 0, 0.0, float("inf")
    for d in sorted(p for p in root.iterdir() if (p / "ledger").is_dir()):
        s, loss = steps_and_loss(d)
        steps += s
        best = min(best, loss if loss is not None else best)
        recs = [r for r in Ledger(d).records(["data_prep", "pretrain"]).values() if r]
        slot += max(r.ended_at or 0 for r in recs) - min(r.submitted_at or 0 for r in recs)
    return {"steps": steps, "slot_s": slot, "best": best}


def min_resource(a: argparse.Namespace) -> int:
    """ASHA's first rung: ``--min-resource``, or about iters / 27 (at least 4): three rungs below the full length
    at reduction factor 3, whatever the length (a fixed 4 steps makes six rungs of 2400 and prunes too early)."""
    return a.min_resource or max(4, a.iters // 27)


def run_search(root: Path, a: argparse.Namespace) -> dict[str, float]:
    n = len(a.lrs.split(",")) * len(a.warmups.split(","))
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "-m",
        *base(a.iters, a.threads),
        f"run.root={root}",
        "search=optuna",
    ]
    cmd += [f"pretrain.lr=choice({a.lrs})", f"pretrain.warmup_iters=choice({a.warmups})"]
    cmd += ["search.sampler=grid", "search.pruner=asha", f"search.min_resource={min_resource(a)}"]
    cmd += [f"search.n_trials={n}"]
    cmd += [f"search.max_concurrent={a.concurrent}", "search.poll_s=0.5"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    while controller_alive(root) or not (root / ".search" / "journal.log").is_file():
        time.sleep(1)
    study = load_study(root)
    files = trials.load_all(root)
    steps = sum(steps_and_loss(Path(t.run_dir))[0] for t in files)
    busy = sum(float(t.user_attrs.get("wall_s", 0.0)) for t in study.trials)
    starts = [t.submitted_at for t in files if t.submitted_at]
    ends = [
        t.submitted_at + float(s.user_attrs.get("wall_s", 0.0))
        for t, s in zip(files, study.trials, strict=True)
        if t.submitted_at
    ]
    span = max(ends) - min(starts)
    done = [t.value for t in study.trials if t.state.name == "COMPLETE" and t.value is not None]
    return {
        "steps": steps,
        "slot_s": busy,
        "best": min(done) if done else float("nan"),
        "idle": 1 - busy / (a.concurrent * span),
        "pruned": sum(t.state.name == "PRUNED" for t in study.trials),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", default="1e-3,3e-3,6e-3,1e-2")
    p.add_argument("--warmups", default="1,2,4,8")
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--concurrent", type=int, default=2)
    p.add_argument(
        "--min-resource", type=int, default=None, help="ASHA's first rung in steps (default: iters/27)"
    )
    p.add_argument("--threads", type=int, default=None, help="pretrain.threads of both (default: see above)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = cpu_busy_s()
        grid = run_grid(Path(tmp) / "grid", a)
        t1 = cpu_busy_s()
        search = run_search(Path(tmp) / "search", a)
        grid["cpu_s"], search["cpu_s"] = t1 - t0, cpu_busy_s() - t1
    print(json.dumps({"grid": grid, "search": search}, indent=1))
    print(f"CPU-seconds, search / grid:     {search['cpu_s'] / grid['cpu_s']:.2f}  (goal <= 0.5)")
    print(f"training steps, search / grid:  {search['steps'] / grid['steps']:.2f}")
    print(f"slot-seconds, search / grid:    {search['slot_s'] / grid['slot_s']:.2f}")
    print(
        f"best final valid loss: search {search['best']:.4f}, grid {grid['best']:.4f} "
        f"(gap {100 * (search['best'] - grid['best']) / grid['best']:+.2f}%, goal within 2%)"
    )
    print(f"idle slot share of the search:  {100 * search['idle']:.1f}%  (goal < 5%)")


if __name__ == "__main__":
    main()
