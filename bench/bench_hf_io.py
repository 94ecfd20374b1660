"""Peak host memory of the streamed Hugging Face import and export, per rank, against what the rank owns.

    python -m bench.bench_hf_io [--hidden 512] [--layers 8] [--vocab 32000] [--tp 2] [--pp 1]

1. Builds a random Llama-style model with transformers (fp32, sharded safetensors) in a temp directory.
2. Import: ``tp*pp`` ranks each build their model slice, then ``engine.models.hf_weights.load_hf`` reads
   their own TP/PP slices from the shards. Per rank: its own shard (bytes of its parameters) and the extra
   peak RSS during the load (VmHWM after ``clear_refs`` minus the RSS before it), as ratios to its shard and
   to the whole model. The imported weights are saved as a dist checkpoint (under that layout).
3. Export: ``engine.convert.hf_export``'s streamed writer (one tensor at a time from the checkpoint,
   shards of ``--shard-mb``) against a baseline in the same script that gathers the whole model first
   (a TP=1 megatron model loading the checkpoint, as the export did before streaming). Extra peak RSS of
   each, as a ratio to the model size. (The export's logit check runs in separate processes, not counted.)

Figures are ratios, never timed assertions. Linux only (/proc/self/status, clear_refs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0); returns the RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def _peak() -> int:
    return _status_kb("VmHWM") * 1024


# ---------------------------------------------------------------------------- workers (subprocesses)


def worker_import(spec: dict[str, Any]) -> dict[str, Any]:
    from engine.checkpoint.save import save
    from engine.models.gpt import build_model
    from engine.models.hf_weights import load_hf
    from engine.runtime import distributed as D
    from pipeline.schema.hf_arch import model_config
    from pipeline.schema.sections import ParallelConfig

    hf = Path(spec["hf_dir"])
    model = model_config(hf, seq_length=32)
    par = ParallelConfig(micro_batch_size=1, global_batch_size=1, tp=spec["tp"], pp=spec["pp"])
    D.init(par.tp, par.pp, None, seed=1, threads=1)
    try:
        chunks = build_model(model, par, model.vocab_size or 0)
        own = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        before = _reset_peak()
        load_hf(chunks, hf, model)
        extra = _peak() - before
        save(Path(spec["ckpt"]), 0, model_chunks=chunks, optimizer=None, scheduler=None, state={})
        return {"rank": D.rank(), "own_bytes": own, "extra_peak_bytes": extra}
    finally:
        D.shutdown()


def worker_export(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine.checkpoint.latest import find_latest
    from pipeline.schema.hf_arch import model_config

    hf = Path(spec["hf_dir"])
    model = model_config(hf, seq_length=32)
    ckpt = find_latest(Path(spec["ckpt"]), collective=False)
    if spec["mode"] == "streamed":
        from engine.convert.hf_export import (
            checkpoint_tensors,
            iter_checkpoint_tensors,
            padded_vocab,
            write_shards,
        )
        from engine.models.hf_weights import to_hf_tensors

        torch.set_num_threads(1)
        before = _reset_peak()
        meta = checkpoint_tensors(ckpt)
        stream = to_hf_tensors(iter_checkpoint_tensors(ckpt, model), model, padded_vocab(meta))
        write_shards(stream, Path(spec["out"]), spec["shard_bytes"])
    else:  # baseline: the whole model gathered into one TP=1 megatron model, then written
        from engine.checkpoint.load import load_weights
        from engine.convert.hf_export import write_shards
        from engine.models.gpt import build_model, unwrap
        from engine.models.hf_weights import full_state_dict, to_hf_tensors
        from engine.runtime import distributed as D
        from pipeline.schema.sections import ParallelConfig

        D.init(1, 1, None, seed=0, threads=1)
        try:
            before = _reset_peak()
            chunks = build_model(
                model, ParallelConfig(micro_batch_size=1, global_batch_size=1), model.vocab_size or 0
            )
            load_weights(ckpt, chunks)
            padded = unwrap(chunks[0]).vocab_size
            write_shards(
                to_hf_tensors(full_state_dict(chunks[0]), model, padded),
                Path(spec["out"]),
                spec["shard_bytes"],
            )
        finally:
            D.shutdown()
    return {"extra_peak_bytes": _peak() - before}


# ---------------------------------------------------------------------------- driver


def build_model_dir(out: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(out, safe_serialization=True, max_shard_size="50MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_ranks(mode: str, spec: dict[str, Any], world: int, tmp: Path) -> list[dict[str, Any]]:
    from engine.runtime.distributed import free_port
    from tests.support.env import rank_env

    port = free_port()
    procs = []
    for rank in range(world):
        path = tmp / f"{mode}-{rank}.json"
        env = rank_env(rank, world, port, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, __file__, "--worker", mode, json.dumps(spec), str(path)]
        procs.append((subprocess.Popen(cmd, env=env, cwd=ROOT), path))
    out = []
    for p, path in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"{mode} worker failed (exit {p.returncode})")
        out.append(json.loads(path.read_text()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--shard-mb", type=float, default=50)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        mode, spec, path = args.worker
        fn = worker_import if mode == "import" else worker_export
        Path(path).write_text(json.dumps(fn(json.loads(spec))))
        return
    mb = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_bytes = build_model_dir(tmp / "hf", args.hidden, args.layers, args.vocab)
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {model_bytes / mb:.0f} MiB fp32"
        )
        spec = {"hf_dir": str(tmp / "hf"), "ckpt": str(tmp / "ckpt"), "tp": args.tp, "pp": args.pp}
        ranks = run_ranks("import", spec, args.tp * args.pp, tmp)
        print(f"import under TP{args.tp} PP{args.pp} (extra peak RSS during load_hf, per rank):")
        for r in sorted(ranks, key=lambda r: r["rank"]):
            own, extra = r["own_bytes"], r["extra_peak_bytes"]
            print(
                f"  rank {r['rank']}: own shard {own / mb:.0f} MiB, extra peak {extra / mb:.1f} MiB = "
                f"{extra / own:.2f}x own shard, {extra / model_bytes:.2f}x model"
            )
        results = {}
        for mode in ("gathered", "streamed"):
            espec = {
                **spec,
                "mode": mode,
                "out": str(tmp / f"out-{mode}"),
                "shard_bytes": int(args.shard_mb * mb),
            }
            Path(espec["out"]).mkdir()
            results[mode] = run_ranks("export-" + mode, espec, 1, tmp)[0]["extra_peak_bytes"]
        print(f"export (extra peak RSS of the writing process, shards of {args.shard_mb:g} MiB):")
        for mode, extra in results.items():
            print(f"  {mode:<9} {extra / mb:.0f} MiB = {extra / model_bytes:.2f}x model")
        print(f"  streamed / gathered: {results['streamed'] / max(results['gathered'], 1):.2f}")


if __name__ == "__main__":
    main()
