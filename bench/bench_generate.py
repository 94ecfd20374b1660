"""Generation tokens/s of the engine's generator against ``transformers`` ``generate`` and full recomputation.

    python -m bench.bench_generate [--batch 8 64] [--prompt 32] [--new 64] [--rounds 2] [--threads 2] [--json F]

Same model (megatron GPTModel, random weights, fp32 on CPU / the GPU when there is one), same prompts, same
thread count. For each batch size, two modes: greedy, and sampled (temperature 0.8, top-k 50, top-p 0.95;
both generators seeded, so samples differ between them but follow the same distribution). Prints the best of
``--rounds`` for each path.

- Engine with megatron's KV cache against full recomputation (greedy, the first batch size): both must give
  the same tokens (checked); ratio cache / recompute.
- Against ``transformers`` ``generate`` (CPU, ``--no-hf`` skips it): the model is Llama-shaped (RMSNorm, SwiGLU,
  RoPE, no biases), saved as a checkpoint and exported with the project's exporter
  (``engine.convert.hf_export.export``, which checks its logits against megatron's); transformers then
  generates from the same left-padded prompts with its KV cache, in a fresh process with the same thread
  count, exactly ``--new`` tokens each. Prints its tokens/s, the ratio engine / transformers, and for greedy
  the share of prompts whose tokens are identical in both.
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

SAMPLED = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
MODES = {"greedy": {}, "sampled": SAMPLED}

HF_GENERATE = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
model_dir, prompts_file, modes, new, rounds, threads = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
torch.set_num_threads(threads)
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
figures = {}
for batch, prompts in json.load(open(prompts_file)).items():
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    for mode, kw in json.loads(modes).items():
        torch.manual_seed(0)
        best, out = 0.0, None
        for _ in range(rounds):
            t0 = time.perf_counter()
            with torch.no_grad():
                out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=bool(kw), **kw, pad_token_id=0, eos_token_id=None, use_cache=True)
            best = max(best, len(prompts) * new / (time.perf_counter() - t0))
        figures[f"{batch}/{mode}"] = {"tokens_per_s": best, "tokens": out[:, width:].tolist()}
print(json.dumps(figures))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64], help="batch sizes")
    ap.add_argument("--prompt", type=int, default=32, help="longest prompt (others are shorter)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = ap.parse_args()

    import torch

    g = torch.Generator().manual_seed(0)
    prompts = {
        b: [
            torch.randint(0, VOCAB, (max(1, args.prompt - (i * 5) % args.prompt),), generator=g).tolist()
            for i in range(b)
        ]
        for b in args.batch
    }
    engine, state = engine_generate(prompts, args)
    print(
        f"generation, {engine['device']}, prompts <= {args.prompt}, {args.new} new tokens, {args.threads} threads"
    )
    print(
        f"  batch {args.batch[0]} greedy: kv cache {engine['kv_cache']:.1f} vs recompute {engine['recompute']:.1f}"
        f" tokens/s, ratio cache/recompute = {engine['ratio']:.2f}x (same tokens)"
    )
    figures: dict[str, Any] = {k: engine[k] for k in ("kv_cache", "recompute", "ratio", "device")}
    hf = {} if args.no_hf else hf_generate(state, prompts, args)
    for key, run in engine["runs"].items():
        line = f"  batch {key.replace('/', ' '):15s} engine {run['tokens_per_s']:8.1f} tokens/s"
        figures[key] = {"engine": run["tokens_per_s"]}
        if key in hf:
            ratio = run["tokens_per_s"] / hf[key]["tokens_per_s"]
            figures[key] |= {"transformers": hf[key]["tokens_per_s"], "ratio": ratio}
            line += (
                f"  transformers {hf[key]['tokens_per_s']:8.1f} tokens/s  engine/transformers {ratio:.2f}x"
            )
            if key.endswith("greedy"):
                same = sum(a == b for a, b in zip(hf[key]["tokens"], run["tokens"]))
                figures[key]["same_tokens"] = same / len(run["tokens"])
                line += f"  identical tokens {same}/{len(run['tokens'])}"
        print(line)
    if args.no_hf:
        print("  transformers generate: skipped (--no-hf)")
    if args.json:
        args.json.write_text(json.dumps(figures) + "\n")


def engine_generate(prompts: dict[int, list[list[int]]], args: Any) -> tuple[dict[str, Any], list[Any]]:
    """The engine's figures per ``batch/mode`` (and KV cache vs recomputation) and the model's weights."""

    from engine.models.generate import SamplingParams, generate
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.sections import ParallelConfig

    D.init(1, 1, seed=1, threads=args.threads)
    try:
        chunks = build_model(ModelConfig(**MODEL), ParallelConfig(), VOCAB)

        def best(batch: list[list[int]], cache: bool = True, **kw: Any) -> tuple[float, list[list[int]]]:
            top, out = 0.0, None
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                out = generate(
                    chunks,
                    batch,
                    SamplingParams(max_new_tokens=args.new, **kw),
                    vocab_size=VOCAB,
                    use_cache=cache,
                )
                top = max(top, sum(len(t) for t in out.tokens) / (time.perf_counter() - t0))
            assert out is not None
            return top, out.tokens

        runs = {}
        for b, batch in prompts.items():
            for mode, kw in MODES.items():
                rate, tokens = best(batch, **kw)
                runs[f"{b}/{mode}"] = {"tokens_per_s": rate, "tokens": tokens}
        first = args.batch[0]
        recompute, tokens = best(prompts[first], cache=False)
        if tokens != runs[f"{first}/greedy"]["tokens"]:
            raise SystemExit("bench_generate: the KV cache and recomputation produced different tokens")
        cached = runs[f"{first}/greedy"]["tokens_per_s"]
        figures = {"runs": runs, "kv_cache": cached, "recompute": recompute, "ratio": cached / recompute}
        figures["device"] = D.device().type
        return figures, [c.state_dict() for c in chunks]  # the same weights, for the export
    finally:
        D.shutdown()


def hf_generate(
    state: list[dict[str, Any]], prompts: dict[int, list[list[int]]], args: Any
) -> dict[str, Any]:
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
            json.dumps(MODES),
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
