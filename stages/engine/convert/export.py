"""Export a training checkpoint (any saved layout) to a Hugging Face directory, verified by logits.

``export(model, checkpoint, out, tokenizer_dir)`` loads the checkpoint's weights into a one-rank (TP=1,
PP=1) megatron model (dist_checkpointing reshards whatever TP/PP/VPP/DP layout or distributed-optimizer
setting saved it), converts it tensor by tensor with stages.engine.convert.hf's table into size-capped
``model-XXXXX-of-YYYYY.safetensors`` shards with ``model.safetensors.index.json``, and writes config.json,
generation_config.json and the tokenizer files (tokenizer.json, tokenizer_config.json with the chat template).

Then it checks itself: transformers loads the directory on CPU (fp32) and its logits on a fixed batch are
compared with the megatron model's. ``export_manifest.json`` records the checkpoint, the shards with their
sha256, the batch and the maximum absolute / relative logit difference. Everything is written into a temp
directory that is renamed to ``out`` only when the difference is within tolerance; otherwise ExportError
and nothing at ``out``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import ModelConfig, ParallelConfig

MANIFEST = "export_manifest.json"
TOLERANCE = 1e-4
"""Largest relative logit difference (max |megatron - transformers| / max |megatron|) an export may show (fp32)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
PIPELINE_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|assistant|>"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] == 'user' %}{% endif %}"
)
"""The pipeline's own prompt format (data_prep-trained tokenizers): ``<|user|>q<|assistant|>a<|endoftext|>``."""


class ExportError(RuntimeError):
    """The export could not be written or did not pass its logit check; nothing was left at ``out``."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_shards(tensors: Any, out: Path, max_shard_bytes: int = 2 << 30) -> dict[str, Any]:
    """Write (name, tensor) pairs as safetensors shards of at most ``max_shard_bytes`` plus the index."""
    from safetensors.torch import save_file

    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if parts[-1] and size + nbytes > max_shard_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = t
        size += nbytes
        total += nbytes
    n = len(parts)
    weight_map: dict[str, str] = {}
    files = []
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in part}
        files.append(fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": files, "total_size": total, "tensors": len(weight_map)}


def _tokenizer_files(tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    """Copy the tokenizer files; a pipeline-trained tokenizer gets a tokenizer_config.json with its template."""
    src = Path(tokenizer_dir)
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    for f in copied:
        shutil.copyfile(src / f, out / f)
    if "tokenizer_config.json" not in copied:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_file=str(src / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|pad|>"
        )
        fast.chat_template = PIPELINE_CHAT_TEMPLATE
        fast.save_pretrained(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {role: tok.token_to_id(t) for role, t in (("eos", "<|endoftext|>"), ("pad", "<|pad|>"))}
    return {"copied": copied, "ids": ids}


def _batch(vocab: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng(1234)
    return torch.tensor(rng.integers(0, vocab, size=(2, min(seq, 32))), dtype=torch.long)


def export(
    model: ModelConfig,
    checkpoint: Path,
    out: Path,
    tokenizer_dir: Path,
    *,
    tolerance: float = TOLERANCE,
    max_shard_bytes: int = 2 << 30,
    threads: int = 2,
) -> dict[str, Any]:
    """Write and verify the Hugging Face directory ``out``; returns the manifest. One process, one rank."""
    from pipeline.hf_arch import to_hf_config
    from stages.engine import distributed as D
    from stages.engine.checkpoint import load_weights
    from stages.engine.convert.hf import full_state_dict, to_hf_tensors
    from stages.engine.data import load_tokenizer
    from stages.engine.model import build_model, unwrap

    out = Path(out)
    if out.exists():
        raise ExportError(f"{out}: already exists; remove it or pass another --out")
    vocab = model.vocab_size or load_tokenizer(Path(tokenizer_dir) / "tokenizer.json").vocab_size
    to_hf_config(model, vocab)  # fails early, naming the keys, for an architecture without an HF twin
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp.{out.name}.{secrets.token_hex(4)}"
    tmp.mkdir()
    start = time.monotonic()
    par = ParallelConfig(micro_batch_size=1, global_batch_size=1, precision="fp32")
    D.init(1, 1, None, seed=0, threads=threads)
    try:
        chunks = build_model(model, par, vocab)
        load_weights(Path(checkpoint), chunks)
        gpt = unwrap(chunks[0])
        padded = gpt.vocab_size
        shards = write_shards(to_hf_tensors(full_state_dict(chunks[0]), model, padded), tmp, max_shard_bytes)
        tok = _tokenizer_files(Path(tokenizer_dir), tmp)
        eos, pad = tok["ids"]["eos"], tok["ids"]["pad"]
        extra = {"eos_token_id": eos, "bos_token_id": None, "pad_token_id": pad}
        (tmp / "config.json").write_text(json.dumps(to_hf_config(model, vocab, extra), indent=2))
        gen = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        tokens = _batch(vocab, model.seq_length)
        gpt.eval()
        with torch.no_grad():
            pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            ours = gpt(tokens, pos, None)[..., :vocab].float()
    finally:
        D.shutdown()
    theirs = hf_logits(tmp, tokens)
    diff = float((ours - theirs).abs().max())
    rel = diff / float(ours.abs().max())
    manifest = {
        "format": 1,
        "checkpoint": str(checkpoint),
        "model": model.name,
        "architecture": json.loads((tmp / "config.json").read_text())["architectures"][0],
        "vocab_size": vocab,
        "shards": {
            f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in shards["files"]
        },
        "total_size": shards["total_size"],
        "tensors": shards["tensors"],
        "tokenizer": tok["copied"] or ["tokenizer.json", "tokenizer_config.json (written)"],
        "check": {
            "batch": list(tokens.shape),
            "max_abs_diff": diff,
            "max_rel_diff": rel,
            "tolerance": tolerance,
            "passed": rel <= tolerance,
        },
        "seconds": round(time.monotonic() - start, 2),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if rel > tolerance:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(
            f"{checkpoint}: transformers' logits differ from megatron's by {rel:.3g} (relative) > {tolerance}; "
            "nothing written"
        )
    tmp.rename(out)
    return manifest


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits for ``tokens`` (CPU), computed in a fresh process: a process that ran
    megatron (its CPU patches, its process groups) is no clean room for a reference."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "tokens.pt", Path(d) / "logits.pt"
        torch.save(tokens, src)
        code = (
            "import sys, torch\n"
            "from transformers import AutoModelForCausalLM\n"
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()\n"
            "with torch.no_grad():\n"
            "    torch.save(m(torch.load(sys.argv[2])).logits.float(), sys.argv[3])\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(model_dir), str(src), str(dst)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise ExportError(f"{model_dir}: transformers cannot load the export: {done.stderr[-2000:]}")
        return torch.load(dst)
