"""LoRA vs full fine-tuning on the same model: step time and peak RSS, printed as ratios.

    python -m bench.bench_lora [--steps 8] [--repeats 2] [--model small|medium] [--rank 8]

Each run is a fresh one-rank process (the engine's own model, optimizer and trainer, SFT-like steps on a
synthetic source), so its peak RSS (``ru_maxrss`` of that process) covers only what that mode allocates:
weights, gradients and Adam state of the trained parameters, activations. Step time is the median of the
steps after the first (which allocates the optimizer state). Modes: ``full`` (every weight trained) and
``lora`` (``peft.method=lora`` on linear_qkv, linear_proj, linear_fc1 and linear_fc2, rank ``--rank``; the
base frozen). Printed: both figures per mode, and lora / full for each, the median over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 4096
MODELS: dict[str, dict[str, Any]] = {
    "small": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128},
    "medium": {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 128},
}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: ``spec["mode"]`` full or lora; returns step times, RSS and parameter counts."""
    import resource
    import time

    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.engine_worker import build_trainer

    model = ModelConfig(**MODELS[spec["model"]], activation="swiglu", normalization="RMSNorm")
    par = ParallelConfig(micro_batch_size=4, global_batch_size=8)
    stage = TrainStage(
        parallel=par, iters=spec["steps"], warmup_iters=1, threads=spec["threads"], log_interval=1
    )
    peft = {"method": "lora", "rank": spec["rank"]} if spec["mode"] == "lora" else None
    D.init(1, 1, None, seed=stage.seed, threads=stage.threads)
    try:
        worker_spec = {"vocab": VOCAB, "samples": 8 * spec["steps"], "peft": peft}
        chunks, trainer = build_trainer(worker_spec, model, par, stage)
        times = []
        for s in range(spec["steps"]):
            t0 = time.perf_counter()
            trainer.train_step(s)
            times.append(time.perf_counter() - t0)
        params = sum(p.numel() for c in chunks for p in c.parameters())
        trained = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    finally:
        D.shutdown()
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "step_s": statistics.median(times[1:]),
        "rss_mb": rss_kib / 1024,
        "params": params,
        "trained": trained,
    }


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process per measurement (its own peak RSS)."""
    from tests.support.env import rank_env

    with tempfile.TemporaryDirectory() as d:
        spec = {
            "mode": mode,
            "model": args.model,
            "steps": args.steps,
            "rank": args.rank,
            "threads": args.threads,
        }
        out = Path(d) / "out.json"
        env = rank_env(0, 1, PYTHONWARNINGS="ignore")
        done = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = worker(json.loads(args.worker[0]))
        Path(args.worker[1]).write_text(json.dumps(result))
        return
    rows: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    for _ in range(args.repeats):
        for mode in rows:  # interleaved, so a machine-wide slowdown hits both
            rows[mode].append(run(mode, args))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in rows.items()}
    print(
        f"model {args.model} ({MODELS[args.model]}), swiglu, vocab {VOCAB}, batch 8, {args.steps} steps, "
        f"LoRA rank {args.rank} on qkv/proj/fc1/fc2, median of {args.repeats}"
    )
    for m, r in med.items():
        print(
            f"  {m:5s} step {r['step_s'] * 1000:8.1f} ms   peak RSS {r['rss_mb']:8.1f} MB   "
            f"trained {int(r['trained']):,} of {int(r['params']):,} parameters"
        )
    full, lora = med["full"], med["lora"]
    print(
        f"  lora / full: step time {lora['step_s'] / full['step_s']:.2f}x, peak RSS "
        f"{lora['rss_mb'] / full['rss_mb']:.2f}x, trained parameters {lora['trained'] / full['trained']:.4f}x"
    )


if __name__ == "__main__":
    main()
