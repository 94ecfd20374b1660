"""The embedded default's post-training result per seed: eval's table, SFT's greedy vs sampled accuracy.

    python -m bench.bench_rl_demo [--seeds 1 2 3] [--root runs/rl-demo] [--samples 8] [--temperature 1]
                                  [--models sft,rlhf] [--skip-run] [OVERRIDE ...]

For each seed ``s`` it runs ``python -m pipeline run.root=ROOT run.name=rl-demo-s<s> data.seed=s
pretrain.seed=s sft.seed=s rlhf.seed=s OVERRIDE...`` (a run already completed is reused by the ledger;
``--skip-run`` only reads it), prints the wall time and eval's table (``stages/eval/results.json``), and for
each model in ``--models`` scores the held-out task prompts three ways with the engine's generator:

- greedy exact match (what eval reports), split into the task's noisy class (``data.sft_noise``:
  ``stages.tasks.systematic_error``) and the rest;
- sampled: the mean accuracy of ``--samples`` answers per prompt at ``--temperature``, and pass@k (the
  share of prompts with at least one right answer among them), which is what RL with a verifier reward can
  find and reinforce.

The last lines are one JSON record per seed (``--json F`` also writes them to a file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_dir(overrides: list[str]) -> Path:
    from pipeline.cli.compose import load_trials
    from pipeline.schema.identity import run_dir_for

    return run_dir_for(load_trials(overrides, False)[0][1])


def score(run: Path, models: list[str], samples: int, temperature: float, threads: int) -> dict[str, Any]:
    """Greedy and sampled accuracy of each model's final checkpoint on the held-out task prompts."""
    import torch

    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load_weights
    from engine.data.chat import task_prompts
    from engine.data.datasets import load_tokenizer
    from engine.models.generate import SamplingParams, generate
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from pipeline.cli.compose import load_trials
    from stages import tasks

    data = run / "stages" / "data_prep"
    cfg = load_trials(json.loads((run / "bench_overrides.json").read_text()), False)[0][1]
    out: dict[str, Any] = {}
    D.init(1, 1, seed=0, threads=threads)
    try:
        tok = load_tokenizer(data / "tokenizer.json")
        recs = task_prompts(data, "eval_task", tok)  # rendered with the run's chat template, as eval does
        noisy = [tasks.systematic_error(tasks.parse_prompt(r["question"])) is not None for r in recs]
        chunks = build_model(cfg.model, cfg.eval.parallel, tok.vocab_size)
        chunks[0].eval()
        prompts = [tok.encode(r["prompt"]) for r in recs]
        for m in models:
            ckpt = find_latest(run / "stages" / m / "checkpoints", collective=False)
            if ckpt is None:
                continue
            load_weights(ckpt, chunks)
            new = cfg.eval.max_new_tokens
            with torch.no_grad():
                greedy = generate(
                    chunks,
                    prompts,
                    SamplingParams(max_new_tokens=new, stop_tokens=(tok.eod,)),
                    vocab_size=tok.vocab_size,
                    pad_id=tok.pad,
                )
                sampled = generate(
                    chunks,
                    [p for p in prompts for _ in range(samples)],
                    SamplingParams(
                        max_new_tokens=new, temperature=temperature, stop_tokens=(tok.eod,), seed=1
                    ),
                    vocab_size=tok.vocab_size,
                    pad_id=tok.pad,
                )
            g_ok = [tasks.is_correct(tok.decode(t), r["answer"]) for t, r in zip(greedy.tokens, recs)]
            s_ok = [
                [
                    tasks.is_correct(tok.decode(sampled.tokens[i * samples + j]), r["answer"])
                    for j in range(samples)
                ]
                for i, r in enumerate(recs)
            ]

            def mean(xs: list[bool]) -> float:
                return sum(xs) / len(xs) if xs else float("nan")

            out[m] = {
                "greedy": mean(g_ok),
                "greedy_noisy_class": mean([ok for ok, n in zip(g_ok, noisy) if n]),
                "greedy_clean_class": mean([ok for ok, n in zip(g_ok, noisy) if not n]),
                "sampled": mean([x for row in s_ok for x in row]),
                f"pass@{samples}": mean([any(row) for row in s_ok]),
            }
    finally:
        D.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--root", default="runs/rl-demo")
    ap.add_argument("--models", default="sft,rlhf", help="comma-separated stages to score (greedy + sampled)")
    ap.add_argument("--samples", type=int, default=8, help="sampled answers per prompt (pass@k's k)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-run", action="store_true", help="only read runs already completed")
    ap.add_argument("--json", type=Path, default=None, help="append the per-seed records here")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides, e.g. rlhf.iters=50")
    args = ap.parse_args()

    records = []
    for seed in args.seeds:
        overrides = [
            f"run.root={args.root}",
            f"run.name=rl-demo-s{seed}",
            *(f"{k}.seed={seed}" for k in ("data", "pretrain", "sft", "rlhf")),
            *args.overrides,
        ]
        run = run_dir(overrides)
        wall = None
        if not args.skip_run:
            print(f"[seed {seed}] python -m pipeline {' '.join(overrides)}", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run([sys.executable, "-m", "pipeline", *overrides], cwd=ROOT).returncode
            wall = time.perf_counter() - t0
            if rc != 0:
                raise SystemExit(f"bench_rl_demo: seed {seed}: the pipeline exited {rc} (run {run})")
        (run / "bench_overrides.json").write_text(json.dumps(overrides) + "\n")
        results = json.loads((run / "stages" / "eval" / "results.json").read_text())
        from stages.eval import format_table

        print(f"\n[seed {seed}] run {run}" + (f", wall {wall:.0f} s" if wall is not None else ""))
        print(format_table(results))
        models = [m for m in args.models.split(",") if m]
        scores = score(run, models, args.samples, args.temperature, args.threads)
        print(
            f"{'model':<10} {'greedy':>7} {'noisy cls':>9} {'clean cls':>9} {'sampled':>8} "
            f"{'pass@' + str(args.samples):>8}   (T={args.temperature})"
        )
        for m, s in scores.items():
            print(
                f"{m:<10} {s['greedy']:>7.1%} {s['greedy_noisy_class']:>9.1%} {s['greedy_clean_class']:>9.1%} "
                f"{s['sampled']:>8.1%} {s[f'pass@{args.samples}']:>8.1%}"
            )
        records.append(
            {
                "seed": seed,
                "run": str(run),
                "wall_s": wall,
                "task_accuracy": {k: v["task_accuracy"] for k, v in results["models"].items()},
                "scores": scores,
            }
        )
    print()
    for r in records:
        print(json.dumps(r))
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
