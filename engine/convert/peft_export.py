"""Export a LoRA stage's checkpoint as a PEFT adapter directory (``python -m pipeline.export ... --peft``).

``export_peft(model, checkpoint, out, tokenizer_dir)`` writes ``out``: ``adapter_config.json`` (PEFT's LORA
config: r, lora_alpha, lora_dropout, target_modules by Hugging Face module name) and
``adapter_model.safetensors`` with PEFT's key names for a Llama-style model
(``base_model.model.model.layers.<L>.self_attn.q_proj.lora_A.weight``, ...), the tokenizer files and
``export_manifest.json``. megatron's fused linears map onto Hugging Face's separate projections exactly:
the fused qkv's A is shared by q_proj, k_proj and v_proj and its B is cut into their rows (the same
de-interleaving as the weight, engine/models/hf_weights.py), likewise gate_proj / up_proj for a swiglu
fc1; o_proj and down_proj take A and B as they are. The scale alpha / r is the same.

The base the adapters belong to is the one recorded in the checkpoint: a Hugging Face directory is
referenced (``base_model_name_or_path``); a checkpoint of this project is exported first into
``out/base`` (verified like any export). Then the directory checks itself: ``peft`` loads the adapters onto
the base with transformers on CPU and its logits on a fixed batch are compared with the megatron model's
(base + merged adapters); over the tolerance nothing is left at ``out``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from engine.convert.hf_export import (
    TOLERANCE,
    ExportError,
    _batch,
    _tokenizer_files,
    commit_checked,
    export,
    fresh_logits,
    save_safetensors,
)
from pipeline.schema.config import ModelConfig
from pipeline.schema.sections import ParallelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_tensors(
    adapters: dict[str, torch.Tensor], model: ModelConfig, padded_vocab: int
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(PEFT state dict, target module names) from full adapter tensors by global megatron name."""
    from engine.models.hf_tables import match, table_for
    from engine.models.hf_weights import Shapes, _export

    s = Shapes.of(model, padded_vocab)
    table = table_for(model)
    out: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for key, a in sorted(adapters.items()):
        if not key.endswith(".lora_a"):
            continue
        prefix = key[: -len(".lora_a")]
        hf_names, kind, _ = match(f"{prefix}.weight", table)
        parts = _export(kind, adapters[f"{prefix}.lora_b"], s)
        for hf_name, b in zip(hf_names, parts, strict=True):
            module = hf_name.removesuffix(".weight")
            out[f"base_model.model.{module}.lora_A.weight"] = a.float().clone()  # shared A: one copy each
            out[f"base_model.model.{module}.lora_B.weight"] = b.float().contiguous()
            modules.add(module.rsplit(".", 1)[-1])
    return out, sorted(modules)


def adapter_config(rec: dict[str, Any], modules: list[str], base: Path) -> dict[str, Any]:
    """PEFT's LoraConfig as JSON."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": int(rec["rank"]),
        "lora_alpha": float(rec["alpha"]),
        "lora_dropout": float(rec["dropout"]),
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "revision": None,
    }


def export_peft(
    model: ModelConfig,
    checkpoint: Path,
    out: Path,
    tokenizer_dir: Path,
    *,
    tolerance: float = TOLERANCE,
    threads: int = 2,
    source: Path | None = None,
) -> dict[str, Any]:
    """Write and verify the PEFT adapter directory ``out`` of LoRA checkpoint ``checkpoint``; the manifest.
    ``source``: as for :func:`export` (a checkpoint base's export keeps that model's pad_token_id)."""
    from engine.checkpoint.load import load_tensors, load_weights
    from engine.data.datasets import load_tokenizer
    from engine.models.gpt import build_model, unwrap
    from engine.models.lora import adapter_tensors, checkpoint_record
    from engine.runtime import distributed as D
    from pipeline.schema.hf_arch import is_hf_dir, to_hf_config

    out, checkpoint = Path(out), Path(checkpoint)
    if out.exists():
        raise ExportError(f"{out}: already exists; remove it or pass another --out")
    rec = checkpoint_record(checkpoint)
    if rec is None:
        raise ExportError(f"{checkpoint}: not a LoRA checkpoint (peft.method=none): export it merged")
    vocab = model.vocab_size or load_tokenizer(Path(tokenizer_dir) / "tokenizer.json").vocab_size
    to_hf_config(model, vocab)
    model = dataclasses.replace(model, vocab_size=vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp.{out.name}.{secrets.token_hex(4)}"
    tmp.mkdir()
    start = time.monotonic()
    try:
        base = Path(str(rec["base"]).removeprefix("hf:"))
        if is_hf_dir(base):
            base_dir, base_manifest = base.resolve(), None
        else:  # a checkpoint of this project (maybe itself LoRA, then merged): its own verified export
            base_dir = out / "base"
            base_manifest = export(
                model, base, tmp / "base", tokenizer_dir, tolerance=tolerance, threads=threads, source=source
            )
        par = ParallelConfig(micro_batch_size=1, global_batch_size=1, precision="fp32")
        D.init(1, 1, None, seed=0, threads=threads)
        try:
            chunks = build_model(model, par, vocab)
            gpt = unwrap(chunks[0])
            tensors, modules = peft_tensors(adapter_tensors(load_tensors(checkpoint)), model, gpt.vocab_size)
            load_weights(checkpoint, chunks)  # the base with the adapters merged: what PEFT must reproduce
            tokens = _batch(vocab, model.seq_length)
            gpt.eval()
            with torch.no_grad():
                pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
                ours = gpt(tokens, pos, None)[..., :vocab].float()
        finally:
            D.shutdown()
        save_safetensors(tensors, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(rec, modules, base_dir), indent=2))
        tok = _tokenizer_files(Path(tokenizer_dir), tmp)
        real_base = tmp / "base" if base_manifest is not None else base_dir
        theirs = peft_logits(real_base, tmp, tokens)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest = {
        "format": 1,
        "kind": "peft",
        "checkpoint": str(checkpoint),
        "base": str(base_dir),
        "base_export": base_manifest["check"] if base_manifest else None,
        "lora": {k: rec[k] for k in ("rank", "alpha", "dropout", "target_modules")},
        "target_modules": modules,
        "tensors": len(tensors),
        "tokenizer": tok["copied"] or ["tokenizer.json", "tokenizer_config.json (written)"],
    }
    return commit_checked(tmp, out, manifest, ours, theirs, tolerance, start, "peft")


def peft_logits(base_dir: Path, adapter_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' base model with ``peft``'s adapters loaded (fp32, CPU, a fresh process)."""
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from peft import PeftModel\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "m = PeftModel.from_pretrained(m, sys.argv[2]).eval()\n"
        "with torch.no_grad():\n"
        "    torch.save(m(torch.load(sys.argv[3])).logits.float(), sys.argv[4])\n"
    )
    args = [str(base_dir), str(adapter_dir)]
    return fresh_logits(code, args, tokens, f"{adapter_dir}: peft cannot load the adapters")
