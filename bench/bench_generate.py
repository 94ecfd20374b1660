"""Generation tokens/s of the engine's generator with megatron's KV cache against full recomputation.

    python -m bench.bench_generate [--batch 8] [--prompt 32] [--new 64] [--rounds 2] [--threads 2] [--json F]

Same model (megatron GPTModel, random weights, fp32 on CPU / the GPU when there is one), same prompts, same
thread count; greedy decoding, so both paths must produce the same tokens (checked). Prints the best of
``--rounds`` for each path and the ratio cache / recompute.

Against ``transformers`` ``generate`` (CPU, ``--no-hf`` skips it): the model is Llama-shaped (RMSNorm, SwiGLU,
RoPE, no biases), saved as a checkpoint and exported with the project's exporter
(``engine.convert.hf_export.export``, which checks its logits against megatron's); transformers then
generates greedily from the same left-padded prompts with its KV cache, in a fresh process with the same
thread count, exactly ``--new`` tokens each. Prints its tokens/s, the ratio engine (KV cache) / transformers,
and the share of prompts whose greedy tokens are identical in both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MODEL = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "seq_length": 256,
    "vocab_size": 4096,
    # Llama-shaped, so the same weights have a transformers twin (export)
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "add_bias_linear": False,
    "tie_embeddings": False,
}
VOCAB = 4096

HF_GENERATE = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
model_dir, prompts_file, new, rounds, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
torch.set_num_threads(threads)
prompts = json.load(open(prompts_file))
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
width = max(len(p) for p in prompts)
ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
best, out = 0.0, None
for _ in range(rounds):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    dt = time.perf_counter() - t0
    best = max(best, len(prompts) * new / dt)
print(json.dumps({"tokens_per_s": best, "tokens": out[:, width:].tolist()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="longest prompt (others are shorter)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = ap.parse_args()

    import torch

    from engine.models.generate import SamplingParams, generate
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.sections import ParallelConfig

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
        figures: dict[str, Any] = {**best, "ratio": ratio, "device": dev.type}
        if not args.no_hf:
            state = [c.state_dict() for c in chunks]  # the same weights, for the export
    finally:
        D.shutdown()
    if not args.no_hf:
        hf = hf_generate(state, prompts, args)
        figures["transformers"] = hf["tokens_per_s"]
        figures["ratio_vs_transformers"] = best["kv_cache"] / hf["tokens_per_s"]
        same = sum(a == b for a, b in zip(hf["tokens"], tokens["kv_cache"]))
        figures["same_tokens"] = same / len(prompts)
        print(
            f"  transformers {hf['tokens_per_s']:10.1f} tokens/s (generate, KV cache, same weights and threads)"
        )
        print(f"  ratio engine(cache)/transformers = {figures['ratio_vs_transformers']:.2f}x")
        print(f"  identical greedy tokens: {same}/{len(prompts)} prompts")
    else:
        print("  transformers generate: skipped (--no-hf)")
    if args.json:
        args.json.write_text(json.dumps(figures) + "\n")


def hf_generate(state: list[dict[str, Any]], prompts: list[list[int]], args: Any) -> dict[str, Any]:
    """Export the weights (checkpoint -> the project's exporter) and time transformers' generate on them."""
    import subprocess
    import tempfile

    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.save import save
    from engine.convert.hf_export import export
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.sections import ParallelConfig

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        D.init(1, 1, seed=1, threads=args.threads)
        try:
            chunks = build_model(ModelConfig(**MODEL), ParallelConfig(), VOCAB)
            for c, sd in zip(chunks, state):
                c.load_state_dict(sd)
            save(tmp / "ckpt", 0, model_chunks=chunks, optimizer=None, scheduler=None, state={})
            ckpt = find_latest(tmp / "ckpt")
        finally:
            D.shutdown()
        _tokenizer(tmp / "tok")
        export(ModelConfig(**MODEL), ckpt, tmp / "hf", tmp / "tok", threads=args.threads)
        (tmp / "prompts.json").write_text(json.dumps(prompts))
        argv = [
            str(tmp / "hf"),
            str(tmp / "prompts.json"),
            str(args.new),
            str(args.rounds),
            str(args.threads),
        ]
        done = subprocess.run(
            [sys.executable, "-c", HF_GENERATE, *argv], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"bench_generate: transformers generate failed: {done.stderr[-2000:]}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _tokenizer(out: Path) -> None:
    """A word-level tokenizer with VOCAB ids (the exporter copies it; generation works on ids only)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, "<|user|>": 2, "<|assistant|>": 3}
    vocab |= {f"t{i}": i for i in range(4, VOCAB)}
    out.mkdir(parents=True)
    Tokenizer(WordLevel(vocab, unk_token="<|pad|>")).save(str(out / "tokenizer.json"))


if __name__ == "__main__":
    main()
