"""Generation tokens/s of the engine's generator with megatron's KV cache against full recomputation.

    python bench/bench_generate.py [--batch 8] [--prompt 32] [--new 64] [--rounds 2] [--threads 2] [--json F]

Same model (megatron GPTModel, random weights, fp32 on CPU / the GPU when there is one), same prompts, same
thread count; greedy decoding, so both paths must produce the same tokens (checked). Prints the best of
``--rounds`` for each path and the ratio cache / recompute. The comparison with ``transformers`` ``generate``
on the same weights needs an HF export of the model, which this branch does not have yet: skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256}
VOCAB = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="longest prompt (others are shorter)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()

    import torch

    from pipeline.config import ModelConfig, ParallelConfig
    from stages.engine import distributed as D
    from stages.engine.generate import SamplingParams, generate
    from stages.engine.model import build_model

    D.init(1, 1, seed=1, threads=args.threads)
    try:
        chunks = build_model(ModelConfig(**MODEL), ParallelConfig(), VOCAB)
        g = torch.Generator().manual_seed(0)
        lengths = [max(1, args.prompt - (i * 5) % args.prompt) for i in range(args.batch)]
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
        params = SamplingParams(max_new_tokens=args.new)
        best: dict[str, float] = {}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, cache in (("kv_cache", True), ("recompute", False)):
                t0 = time.perf_counter()
                out = generate(chunks, prompts, params, vocab_size=VOCAB, use_cache=cache)
                dt = time.perf_counter() - t0
                n = sum(len(t) for t in out.tokens)
                best[name] = max(best.get(name, 0.0), n / dt)
                tokens[name] = out.tokens
        if tokens["kv_cache"] != tokens["recompute"]:
            raise SystemExit("bench_generate: the KV cache and recomputation produced different tokens")
        ratio = best["kv_cache"] / best["recompute"]
        dev = D.device()
        print(
            f"generation, {dev.type}, batch {args.batch}, prompts <= {args.prompt}, {args.new} new tokens, "
            f"{args.threads} threads"
        )
        print(f"  kv cache     {best['kv_cache']:10.1f} tokens/s")
        print(f"  recompute    {best['recompute']:10.1f} tokens/s")
        print(f"  ratio cache/recompute = {ratio:.2f}x")
        print("  transformers generate: skipped (no HF export of the model on this branch)")
        if args.json:
            args.json.write_text(json.dumps({**best, "ratio": ratio, "device": dev.type}) + "\n")
    finally:
        D.shutdown()


if __name__ == "__main__":
    main()
