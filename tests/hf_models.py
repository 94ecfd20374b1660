"""Tiny random Hugging Face models for the conversion tests, built locally (no hub access).

``llama3`` : Llama-3 style: GQA (4 heads, 2 KV heads), RMSNorm, SwiGLU, RoPE with llama3 scaling
(factor 32), untied embeddings. ``qwen2``: Qwen2 style: query/key/value biases, tied embeddings, a
vocabulary that TP=2 must pad. Both fp32, hidden 64, 2 layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


def make(kind: str, out: Path, seed: int = 0, vocab_size: int | None = None) -> Path:
    """Save a random ``kind`` (llama3 | qwen2) model to ``out`` (config.json + model.safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cls: Any
    if kind == "llama3":
        cfg: Any = LlamaConfig(
            **COMMON,
            vocab_size=vocab_size or 256,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        cls = LlamaForCausalLM
    elif kind == "qwen2":
        cfg = Qwen2Config(**COMMON, vocab_size=vocab_size or 251, tie_word_embeddings=True)
        cls = Qwen2ForCausalLM
    else:
        raise ValueError(kind)
    model = cls(cfg).float()
    with torch.no_grad():  # biases and norms start at 0 / 1: make them random so the mapping is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_logits(model_dir: Path, tokens: list[list[int]]) -> Any:
    """transformers' fp32 logits [b, s, V] on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()
