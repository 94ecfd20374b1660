"""The engine's training path against a nanoGPT-style plain PyTorch GPT that uses SDPA, at two shapes.

    python -m bench.bench_attention [--reps 7] [--steps 16] [--warmup 3] [--shapes demo,4.4x] [--same-process]
                                    [--side-by-side]

Engine: engine (megatron GPTModel, local layer spec, megatron DDP + optimizer, ``Trainer.train_step``;
bench/bench_throughput.py's ``engine_worker``) with ``model.attention_backend=sdpa`` (the default) and, for
comparison, ``unfused`` (megatron's DotProductAttention). Plain: a GPT written the way nanoGPT writes it
([b, s, h] layout, one qkv linear, ``F.scaled_dot_product_attention(is_causal=True)``, GELU MLP, tied
embeddings, torch AdamW, gradient clipping), the same micro batches, the same thread count.

Shapes: ``demo`` = the default run's model (4 layers, hidden 128, 4 heads, seq 128, micro batch 8, global
16); ``4.4x`` = 6 layers, hidden 256 (4.4x the parameters). Each repetition runs every variant once in a
fresh process, in turn, in reversed order every other repetition (interleaved, so slow phases of other load
hit all of them, and a drift or the order favours none); each run reports its
median step time; the figure is the median over repetitions. Prints tokens/s, the ratio engine / plain of
the medians, and the median (min, max) of the per-repetition ratios (each pair of runs ran back to back).
``--same-process``: also, per shape, ``--reps`` fresh processes that each run the engine's step and
nanoGPT's in turn, step by step (nanoGPT then runs in the engine's process: megatron imported, its process
groups, the CPU compatibility layer): the ratio of the two training paths alone.
``--side-by-side``: also, per shape, ``--reps`` pairs of fresh processes, the engine's and nanoGPT's at the
same time, one thread each, each pinned to a core of its own (swapped every other pair): both meet the
same moments of other load on the host, so the ratio of each pair is steadier than that of runs in turn
(needs two cores; per core, not the two-thread figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 4096
SHAPES: dict[str, dict[str, Any]] = {
    "demo": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128},
    "4.4x": {"num_layers": 6, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128},
}
VARIANTS = ("nanogpt", "engine-sdpa", "engine-unfused")


class NanoBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.c_fc, self.mlp_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(NanoBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        nll = F.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), reduction="none")
        return (nll * mask.reshape(-1)).sum()


def nanogpt_step(spec: dict[str, Any]) -> Any:
    """One training step of the nanoGPT-style model (AdamW, clipping) on the engine's batches: ``step(i)``."""
    from bench.bench_throughput import _micro_batches
    from tests.support.synthetic import SyntheticSource

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(1234)
    m = spec["model"]
    model = NanoGPT(m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["seq_length"], VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    source = SyntheticSource(64, VOCAB, m["seq_length"], seed=1)

    def step(i: int) -> None:
        batches = _micro_batches(source, spec, i, 0, 1)
        tokens = sum(b["loss_mask"].sum() for b in batches)
        opt.zero_grad(set_to_none=True)
        for b in batches:
            (model(b["tokens"], b["labels"], b["loss_mask"]) / tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def nanogpt_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.bench_throughput import _timed

    return _timed(nanogpt_step(spec), spec)


def same_process_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine's step and nanoGPT's in one process, alternating step by step (the order swapped every
    step): both run in the engine's process (megatron imported, its groups, the CPU layer), so the ratio
    is that of the two training paths alone, without what differs between the processes."""
    from bench.bench_throughput import engine_trainer
    from engine.runtime import distributed as D

    try:
        steps = {"engine": engine_trainer(spec).train_step, "nanogpt": nanogpt_step(spec)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for i in range(spec["warmup"] + spec["steps"]):
            for name in list(steps) if i % 2 == 0 else list(steps)[::-1]:
                t0 = time.perf_counter()
                steps[name](i)
                if i >= spec["warmup"]:
                    times[name].append(time.perf_counter() - t0)
        return times
    finally:
        D.shutdown()


def _spec(mode: str, model: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "mode": mode,
        "model": model,
        "parallel": {"micro_batch_size": args.micro_batch, "global_batch_size": args.global_batch},
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
    }


def _launch(spec: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    from tests.support.engine_worker import launch

    with tempfile.TemporaryDirectory(prefix=f"bench-{spec['mode']}-") as tmp:
        return launch(1, spec, Path(tmp), timeout_s=600, script=Path(__file__), extra_env=extra_env)


def two_cores() -> bool:
    """Whether this process may run on two cores (``side_by_side`` pins one worker to each)."""
    return len(os.sched_getaffinity(0)) >= 2


def side_by_side(
    a: dict[str, Any],
    b: dict[str, Any],
    rep: int,
    env_a: dict[str, str] | None = None,
    env_b: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Worker specs ``a`` and ``b`` run at the same time, one thread each, each pinned to one of the first two
    cores this process may use (swapped when ``rep`` is odd); their results. Needs ``two_cores()``."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    cores = (first, second) if rep % 2 == 0 else (second, first)
    specs = [{**a, "threads": 1, "cpu": cores[0]}, {**b, "threads": 1, "cpu": cores[1]}]
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_launch, spec, env) for spec, env in zip(specs, (env_a, env_b), strict=True)]
        first, second = (r.result() for r in runs)
    return first, second


def side_by_side_ratios(shape: str, args: argparse.Namespace) -> list[float]:
    """Prints and returns engine sdpa / nanoGPT (tokens/s) of ``args.reps`` pairs run side by side (none, with
    a line saying so, on fewer than two cores)."""
    if not two_cores():
        print(f"{shape:>5} side by side: needs two cores, this process may use one; skipped", flush=True)
        return []
    model = {**SHAPES[shape], "attention_backend": "sdpa"}
    ratios = []
    for rep in range(args.reps):
        engine, plain = side_by_side(_spec("engine", model, args), _spec("nanogpt", model, args), rep)
        ratios.append(statistics.median(plain["step_times"]) / statistics.median(engine["step_times"]))
    print(f"{shape:>5} side by side, one core each: engine sdpa / nanoGPT {_spread(ratios)}", flush=True)
    return ratios


def run_once(variant: str, shape: str, args: argparse.Namespace) -> tuple[float, float]:
    """Tokens per second and per CPU second (median step of one fresh process) of ``variant`` at ``shape``."""
    model = dict(SHAPES[shape])
    if variant.startswith("engine-"):
        model["attention_backend"] = variant.removeprefix("engine-")
    result = _launch(_spec("nanogpt" if variant == "nanogpt" else "engine", model, args))
    tokens = args.global_batch * model["seq_length"]
    return tokens / statistics.median(result["step_times"]), tokens / statistics.median(result["cpu_times"])


def same_process(shape: str, args: argparse.Namespace) -> list[float]:
    """Prints and returns nanoGPT's / the engine's median step time of ``args.reps`` fresh processes, each
    running both steps in turn (``same_process_worker``)."""
    model = {**SHAPES[shape], "attention_backend": "sdpa"}
    ratios = []
    for _ in range(args.reps):
        times = _launch(_spec("same-process", model, args))
        ratios.append(statistics.median(times["nanogpt"]) / statistics.median(times["engine"]))
    print(f"{shape:>5} same process, steps alternating: engine sdpa / nanoGPT {_spread(ratios)}", flush=True)
    return ratios


def _paired(engine: list[float], plain: list[float]) -> list[float]:
    """engine / nanoGPT of each repetition (the runs right next to each other: a slow phase of other load
    hits both sides of a pair, and cancels in its ratio)."""
    return [e / p for e, p in zip(engine, plain, strict=True)]


def _spread(ratios: list[float]) -> str:
    return f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"


def add_run_arguments(p: argparse.ArgumentParser, reps: int) -> None:
    """The options ``_spec`` reads, ``--threads`` aside: repetitions, timed and warm-up steps, batch sizes."""
    p.add_argument("--reps", type=int, default=reps, help="interleaved repetitions (median)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per run (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p, reps=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="demo,4.4x")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument(
        "--same-process", action="store_true", help="also both steps in one process, alternating (per shape)"
    )
    p.add_argument(
        "--side-by-side", action="store_true", help="also both at once, one pinned core each (per shape)"
    )
    args = p.parse_args(argv)
    from bench.bench_throughput import warn_if_busy

    warn_if_busy()
    figures: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        m = SHAPES[shape]
        seen: dict[str, list[float]] = {v: [] for v in VARIANTS}
        per_cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rep in range(args.reps):
            for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                wall, cpu = run_once(variant, shape, args)
                seen[variant].append(wall)
                per_cpu[variant].append(cpu)
        med = {v: statistics.median(x) for v, x in seen.items()}
        cpu_med = {v: statistics.median(x) for v, x in per_cpu.items()}
        paired = {v: _paired(seen[v], seen["nanogpt"]) for v in VARIANTS[1:]}
        figures[shape] = {"tok_s": med, "tok_per_cpu_s": cpu_med, "runs": seen, "paired": paired}
        print(
            f"{shape:>5} ({m['num_layers']} layers, hidden {m['hidden_size']}, seq {m['seq_length']}, "
            f"batch {args.global_batch}/{args.micro_batch}, {args.threads} threads, median of {args.reps}): "
            f"nanoGPT {med['nanogpt']:,.0f} tok/s, engine sdpa {med['engine-sdpa']:,.0f} "
            f"(ratio {med['engine-sdpa'] / med['nanogpt']:.3f}), engine unfused {med['engine-unfused']:,.0f} "
            f"(ratio {med['engine-unfused'] / med['nanogpt']:.3f}); per CPU second: sdpa "
            f"{cpu_med['engine-sdpa'] / cpu_med['nanogpt']:.3f}, unfused "
            f"{cpu_med['engine-unfused'] / cpu_med['nanogpt']:.3f}; paired per repetition: sdpa "
            f"{_spread(paired['engine-sdpa'])}, unfused {_spread(paired['engine-unfused'])}",
            flush=True,
        )
        if args.same_process:
            figures[shape]["same_process"] = same_process(shape, args)
        if args.side_by_side:
            figures[shape]["side_by_side"] = side_by_side_ratios(shape, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json") and Path(sys.argv[1]).is_file():
        worker_spec = json.loads(Path(sys.argv[1]).read_text())
        if "cpu" in worker_spec:  # side by side: this process on its own core (before any thread starts)
            os.sched_setaffinity(0, {worker_spec["cpu"]})
        if worker_spec["mode"] == "engine":
            from bench.bench_throughput import engine_worker

            out = engine_worker(worker_spec)
        elif worker_spec["mode"] == "same-process":
            out = same_process_worker(worker_spec)
        else:
            out = nanogpt_worker(worker_spec)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(worker_spec["out"]).write_text(json.dumps(out))
        sys.exit(0)
    sys.exit(main())
