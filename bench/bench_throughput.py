"""Throughput of the pretrain stage's training path against a minimal plain-PyTorch loop on the same model.

    python -m bench.bench_throughput [--steps 20] [--warmup 3] [--rounds 2] [--no-dist] [--gpu-only] [--profile]

Engine path: engine (distributed init, megatron GPTModel with the local layer spec in megatron DDP,
megatron optimizer, ``Trainer.train_step``: micro batches from a sample source through
``get_forward_backward_func``, optimizer step, LR schedule, metrics reduction). Plain path: a GPT of the
same shapes written with torch.nn (attention as megatron's local DotProductAttention computes it:
baddbmm, masked softmax, bmm), torch AdamW, gradient clipping, the same micro batches. Both use the same
torch thread count and report the median step time of ``--steps`` steps after ``--warmup``, as tokens/s.

Rows: one rank (engine vs plain, ``--threads`` threads each) and two data-parallel ranks (engine with DDP and
the distributed optimizer vs torch DDP, one thread per rank, the same global batch). Each measurement is
a fresh process (the CPU compatibility layer patches torch process-wide, the plain loop must not see it);
``--rounds`` alternates engine and plain runs and keeps each side's best, to damp noise from other load.

With CUDA, the engine path also trains Llama shapes in bf16 on one GPU (``--gpu-models``: the 1B of
conf/model/llama3.2-1b.yaml and the 3B, the largest that fits one H200 without the distributed optimizer;
``--gpu-seqs`` 4096,8192) and prints tokens/s, TFLOP/s and MFU (pipeline.schema.estimates.step_flops against
``--peak-tflops``, 790: the H200's measured bf16 matmul peak) and, with ``--profile``, a torch profiler
summary; without CUDA that part is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

CPU_MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128}
VOCAB = 4096
TARGET_RATIO = 0.85


# ---------------------------------------------------------------------------- the plain PyTorch GPT


class Block(nn.Module):
    """Pre-norm transformer layer in megatron's [s, b, h] layout, attention as its local DotProductAttention."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-5), nn.LayerNorm(hidden, eps=1e-5)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def attention(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        n, d = self.heads, self.head_dim
        q, k, v = self.qkv(x).view(s, b * n, 3 * d).split(d, dim=-1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b n, s, d]
        scores = torch.baddbmm(q.new_empty(b * n, s, s), q, k.transpose(1, 2), beta=0.0, alpha=d**-0.5)
        probs = scores.masked_fill(causal, -10000.0).softmax(dim=-1)
        context = torch.bmm(probs, v).view(b, n, s, d).permute(2, 0, 1, 3).reshape(s, b, h)
        return self.proj(context)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x), causal)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """Learned positions, tied output layer, final LayerNorm: the shapes of the engine's GPTModel."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, 4 * hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden, eps=1e-5)
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        self.register_buffer("causal", mask, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = (self.embed(tokens) + self.pos.weight[:s]).transpose(0, 1)  # [s, b, h]
        for block in self.blocks:
            x = block(x, self.causal[:s, :s])
        logits = F.linear(self.norm(x), self.embed.weight).float()
        nll = F.cross_entropy(logits.flatten(0, 1), labels.t().reshape(-1), reduction="none")
        return (nll * mask.t().reshape(-1)).sum()


# ---------------------------------------------------------------------------- workers (one process each rank)


def _micro_batches(
    source: Any, spec: dict[str, Any], step: int, dp_rank: int, dp: int
) -> list[dict[str, Any]]:
    """The same global-sample-index slice the trainer takes, as CPU tensors."""
    from engine.data.datasets import collate, sample_range

    idx, mbs = sample_range(step, spec["global_batch"], dp_rank, dp), spec["micro_batch"]
    out = []
    for start in range(idx.start, idx.stop, mbs):
        batch = collate([source[i] for i in range(start, min(start + mbs, idx.stop))])
        out.append({k: torch.from_numpy(v) for k, v in batch.items()})
    return out


def _timed(run_step: Any, spec: dict[str, Any]) -> dict[str, list[float]]:
    """Wall and process CPU seconds and minor page faults of each step after the warm-up (CPU time is robust
    to other load; faults show the allocator giving memory back and taking it again, engine.runtime.host_memory)."""
    import resource

    wall, cpu, faults = [], [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run_step(i)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        faults.append(float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    w = spec["warmup"]
    return {"step_times": wall[w:], "cpu_times": cpu[w:], "minor_faults": faults[w:]}


def plain_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain loop: torch.nn GPT, AdamW, clip, torch DDP (gloo) when WORLD_SIZE > 1."""
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(1234)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    m = spec["model"]
    model: nn.Module = PlainGPT(
        m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["seq_length"], VOCAB
    )
    if world > 1:
        addr = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=world)
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    from tests.support.synthetic import SyntheticSource

    source = SyntheticSource(64, VOCAB, m["seq_length"], seed=1)

    def step(i: int) -> None:
        batches = _micro_batches(source, spec, i, rank, world)
        tokens = sum(b["loss_mask"].sum() for b in batches) * world
        opt.zero_grad(set_to_none=True)
        for b in batches:
            (model(b["tokens"], b["labels"], b["loss_mask"]) / tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    times = _timed(step, spec)
    if world > 1:
        dist.destroy_process_group()
    return times


def engine_trainer(spec: dict[str, Any]) -> Any:
    """engine's init, model, optimizer and Trainer on a synthetic source (``D.shutdown()`` after use)."""
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.engine_worker import build_trainer

    model = ModelConfig(**spec["model"])
    par = ParallelConfig(**spec["parallel"])
    stage = TrainStage(parallel=par, iters=1000, lr=1e-4, warmup_iters=0, threads=spec["threads"])
    D.init(par.tp, par.pp, par.vpp, seed=stage.seed, threads=stage.threads)
    _, trainer = build_trainer({"vocab": spec.get("vocab", VOCAB), "samples": 64}, model, par, stage)
    return trainer


def engine_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine path: ``engine_trainer``'s ``Trainer.train_step``, timed."""
    from engine.runtime import distributed as D

    try:
        trainer = engine_trainer(spec)
        times = _timed(trainer.train_step, spec)
        loss = trainer.train_step(spec["warmup"] + spec["steps"])["loss"]
        out = {**times, "final_loss": loss}
        if torch.cuda.is_available():
            out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if spec.get("profile"):
            out["profile"] = _profile(trainer, spec["warmup"] + spec["steps"] + 1)
        return out
    finally:
        D.shutdown()


def _profile(trainer: Any, step: int) -> str:
    """torch profiler summary of two training steps: where the time goes, by CUDA time (CPU time without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(2):
            trainer.train_step(step + i)
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


# ---------------------------------------------------------------------------- orchestration


def measure(kind: str, world: int, spec: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    """(tokens/s by wall clock, tokens per CPU second of rank 0, rank 0's result) of one fresh run of ``kind``."""
    from tests.support.engine_worker import launch

    spec = {**spec, "mode": kind}
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as tmp:
        result = launch(world, spec, Path(tmp), timeout_s=600, script=Path(__file__))
    tokens = spec["global_batch"] * spec["model"]["seq_length"]
    wall, cpu = statistics.median(result["step_times"]), statistics.median(result["cpu_times"])
    return tokens / wall, tokens / cpu, result


def compare(label: str, world: int, spec: dict[str, Any], rounds: int) -> dict[str, float]:
    """Best-of-``rounds`` figures for engine and plain, alternated; prints the row and returns the ratios.

    ``ratio``: wall-clock tokens/s, engine / plain (the figure that counts on a quiet machine);
    ``cpu_ratio``: the same per CPU second of rank 0 (less sensitive to other processes on the machine).
    """
    best = {k: [0.0, 0.0] for k in ("engine", "plain")}
    for _ in range(rounds):
        for kind in ("plain", "engine"):
            wall, cpu, _ = measure(kind, world, spec)
            best[kind] = [max(best[kind][0], wall), max(best[kind][1], cpu)]
    ratio = best["engine"][0] / best["plain"][0]
    cpu_ratio = best["engine"][1] / best["plain"][1]
    verdict = "ok" if ratio >= TARGET_RATIO else f"BELOW the {TARGET_RATIO} target"
    print(
        f"{label:<48} engine {best['engine'][0]:>7,.0f} tok/s   plain {best['plain'][0]:>7,.0f} tok/s   "
        f"ratio {ratio:.3f} ({verdict}); per CPU second: ratio {cpu_ratio:.3f}",
        flush=True,
    )
    return {
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "engine_tok_s": best["engine"][0],
        "plain_tok_s": best["plain"][0],
    }


def cpu_spec(args: argparse.Namespace, threads: int, parallel: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": dict(CPU_MODEL),
        "parallel": {
            "micro_batch_size": args.micro_batch,
            "global_batch_size": args.global_batch,
            **parallel,
        },
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "threads": threads,
        "warmup": args.warmup,
        "steps": args.steps,
    }


GPU_SHAPES: dict[str, dict[str, Any]] = {
    "llama3.2-1b": {},
    # Llama 3.2 3B (Meta's config.json): the largest Llama-family model that trains on one H200 with the
    # distributed optimizer off (bf16 weights + fp32 main params, grads and Adam: ~18 bytes per parameter,
    # 58 GB at 3.2B; Llama 3.1 8B would need 144 GB before activations).
    "llama3.2-3b": {
        "name": "llama3.2-3b",
        "num_layers": 28,
        "hidden_size": 3072,
        "num_attention_heads": 24,
        "num_query_groups": 8,
        "kv_channels": 128,
        "ffn_hidden_size": 8192,
    },
}


def gpu_llama(args: argparse.Namespace) -> dict[str, Any] | None:
    """Engine path on Llama shapes in bf16 on one GPU: tokens/s, TFLOP/s and MFU; None without CUDA.

    Each (shape, seq) is a fresh process; the global batch holds ``--gpu-tokens`` tokens (micro batch 1).
    MFU = model FLOPs (pipeline.schema.estimates.step_flops) per second / ``--peak-tflops``.
    """
    if not torch.cuda.is_available():
        print("GPU part skipped: CUDA is not available (Llama bf16 MFU needs a GPU)", flush=True)
        return None
    from pipeline.cli.plan import compose_config
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.estimates import padded_vocab, step_flops

    base = compose_config(["model=llama3.2-1b"]).model
    peak = args.peak_tflops * 1e12
    t_start, rows = time.time(), {}
    print(
        f"GPU {torch.cuda.get_device_name()}: bf16, 1 GPU, micro batch 1, {args.gpu_tokens} tokens per step, "
        f"median of {args.steps} steps after {args.warmup}; MFU against {args.peak_tflops:g} TFLOP/s",
        flush=True,
    )
    for shape in args.gpu_models.split(","):
        for seq in (int(x) for x in args.gpu_seqs.split(",")):
            label = f"{shape} seq {seq}"
            if args.gpu_deadline_s and time.time() - t_start > args.gpu_deadline_s:
                print(f"{label:<24} skipped: --gpu-deadline-s reached", flush=True)
                continue
            model = ModelConfig(**{**base.__dict__, **GPU_SHAPES[shape], "seq_length": seq})
            batch = max(1, args.gpu_tokens // seq)
            spec = {
                "model": model.__dict__,
                "vocab": model.vocab_size,
                "parallel": {"micro_batch_size": 1, "global_batch_size": batch, "precision": "bf16"},
                "global_batch": batch,
                "threads": 4,
                "warmup": args.warmup,
                "steps": args.steps,
                "profile": args.profile and not rows,
            }
            try:
                tokens_per_s, _, result = measure("engine", 1, spec)
            except RuntimeError as e:  # out of memory or a failure: report it, go on with the next
                print(f"{label:<24} FAILED: {str(e)[-600:]}", flush=True)
                rows[label] = {"error": str(e)[-2000:]}
                continue
            flops, _ = step_flops(model, padded_vocab(model, model.vocab_size, 1), batch)
            tflops = flops * tokens_per_s / (batch * seq) / 1e12
            rows[label] = {
                "tokens_per_s": tokens_per_s,
                "tflops": tflops,
                "mfu": tflops * 1e12 / peak,
                "max_memory_gib": result.get("max_memory_gib"),
                "final_loss": result.get("final_loss"),
            }
            print(
                f"{label:<24} {tokens_per_s:>9,.0f} tok/s  {tflops:6.1f} TFLOP/s  MFU {tflops * 1e12 / peak:6.1%}  "
                f"peak memory {result.get('max_memory_gib', 0):.1f} GiB",
                flush=True,
            )
            if result.get("profile"):
                print(
                    f"torch profiler, 2 steps of {label} (top 20 by CUDA time):\n{result['profile']}",
                    flush=True,
                )
    first = next((v for v in rows.values() if "mfu" in v), None)
    return {"rows": rows, **({"tokens_per_s": first["tokens_per_s"], "mfu": first["mfu"]} if first else {})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="alternating repeats; best of each side")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the one-rank runs")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--no-dist", action="store_true", help="skip the two-rank row")
    p.add_argument("--gpu-only", action="store_true", help="only the 1B Llama GPU part")
    p.add_argument("--gpu-models", default="llama3.2-1b,llama3.2-3b", help=f"of {sorted(GPU_SHAPES)}")
    p.add_argument("--gpu-seqs", default="4096,8192", help="sequence lengths, comma-separated")
    p.add_argument("--gpu-tokens", type=int, default=32768, help="tokens per global batch")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak (H200: ~790)")
    p.add_argument("--profile", action="store_true", help="torch profiler summary of the first GPU row")
    p.add_argument("--gpu-deadline-s", type=float, default=0, help="skip GPU rows started after this")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


def warn_if_busy() -> None:
    """Other processes on the cores make wall-clock figures (two threads most of all) meaningless: say so."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        print(
            f"WARNING: load average {load:.1f} on {cores} cores before starting: wall-clock figures are "
            "unreliable; compare the per-CPU-second ratios or rerun on a quiet machine",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warn_if_busy()
    figures: dict[str, Any] = {}
    if not args.gpu_only:
        m = CPU_MODEL
        print(
            f"GPT {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
            f"seq {m['seq_length']}, vocab {VOCAB}, global batch {args.global_batch}, micro batch "
            f"{args.micro_batch}, fp32, median of {args.steps} steps after {args.warmup}",
            flush=True,
        )
        figures["single_rank"] = compare(
            f"1 rank, {args.threads} threads", 1, cpu_spec(args, args.threads, {}), args.rounds
        )
        if not args.no_dist:
            dist_par = {"distributed_optimizer": True}
            figures["dp2_distributed_optimizer"] = compare(
                "2 ranks x 1 thread, DDP + distributed optimizer", 2, cpu_spec(args, 1, dist_par), args.rounds
            )
    figures["gpu"] = gpu_llama(args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json") and Path(sys.argv[1]).is_file():
        worker_spec = json.loads(Path(sys.argv[1]).read_text())
        worker = engine_worker if worker_spec["mode"] == "engine" else plain_worker
        out = worker(worker_spec)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(worker_spec["out"]).write_text(json.dumps(out))
        sys.exit(0)
    sys.exit(main())
