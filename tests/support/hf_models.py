"""Tiny random Hugging Face models for the conversion tests, built locally (no hub access).

``tokenizer="llama3"``: a Llama-3-style tokenizer (its own special tokens and chat template, none of the
pipeline's role tokens) instead of the pipeline-style one; ``tokenizer="chatml"``: a Qwen2-style one
(ChatML template, ``<|im_end|>`` as eos, none of the pipeline's role tokens); ``"qwen2-instruct"``: the same
with Qwen2-Instruct's default system turn. ``llama3`` : Llama-3 style: GQA (4 heads, 2 KV heads), RMSNorm, SwiGLU, RoPE with llama3 scaling
(factor 32), untied embeddings. ``qwen2``: Qwen2 style: query/key/value biases, tied embeddings, a
vocabulary that TP=2 must pad. ``qwen3``: per-head query/key norms, a head_dim (24) unlike hidden / heads.
Mixture of Experts, 4 experts of width 32, top-2: ``qwen3_moe`` (q/k norms, renormalised top-k),
``mixtral`` (experts w1/w2/w3), ``qwen2_moe`` (query/key/value biases, top-k not renormalised, a shared
expert of width 48 with its sigmoid gate, layer 1 dense through mlp_only_layers). All fp32, hidden 64,
2 layers.
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


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|assistant|>"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
)
"""The pipeline's prompt format as a chat template."""

ROLE_TOKENS = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]


def make_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE with the role tokens and a chat template, saved as tokenizer.json +
    tokenizer_config.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    text = [
        f"What comes after {i}? {i + 1}. The quick brown fox jumps over the lazy dog." for i in range(300)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=ROLE_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return int(tok.get_vocab_size(with_added_tokens=True))


LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""A Llama-3-style chat template (header tokens, end-of-turn token), written for these tests."""


def make_llama3_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """A Llama-3-style tokenizer: byte-level BPE whose special tokens are Llama 3's (no pipeline role token),
    bos ``<|begin_of_text|>``, eos ``<|eot_id|>`` (end of turn), no pad token, and LLAMA3_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    text = [
        f"What comes after {i}? {i + 1}. A user and an assistant talk about the river." for i in range(300)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=LLAMA3_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA3_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return int(tok.get_vocab_size(with_added_tokens=True))


CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML as Qwen's templates write it (here without a default system turn)."""

QWEN2_INSTRUCT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2-Instruct's chat template (ChatML; a default system turn when the conversation has none)."""


QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's pre-tokenizer pattern (its tokenizer.json; transformers' Qwen2Tokenizer)."""


def make_chatml_tokenizer(out: Path, vocab_size: int = 320, template: str = CHATML_TEMPLATE) -> int:
    """A Qwen2-style tokenizer: byte-level BPE after Qwen2's pre-tokenizer (digits one per token), ChatML's
    special tokens (no pipeline role token), eos ``<|im_end|>`` (end of turn), pad ``<|endoftext|>``, no bos,
    and ``template``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()  # Qwen2's own pipeline (transformers' Qwen2Tokenizer builds the same)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    text = [f"What comes after {i}? {i + 1}. The system, the user and the assistant." for i in range(300)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return int(tok.get_vocab_size(with_added_tokens=True))


TOKENIZERS = {
    "llama3": make_llama3_tokenizer,
    "chatml": make_chatml_tokenizer,
    "qwen2-instruct": lambda out: make_chatml_tokenizer(out, template=QWEN2_INSTRUCT_TEMPLATE),
}
"""``make(tokenizer=...)``: the published-style tokenizers (else the pipeline-style ``make_tokenizer``)."""


def make(
    kind: str, out: Path, seed: int = 0, vocab_size: int | None = None, tokenizer: str = "pipeline"
) -> Path:
    """Save a random ``kind`` (llama3 | qwen2) model with its tokenizer to ``out`` (config.json, model.safetensors,
    tokenizer files). llama3: model vocabulary = the tokenizer's; qwen2: 3 more rows (as published Qwen2
    checkpoints have), an odd size that TP=2 pads."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok_size = TOKENIZERS.get(tokenizer, make_tokenizer)(out)
    special: dict[str, Any] = {}
    if tokenizer in TOKENIZERS:
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(str(out / "tokenizer.json"))
        special = (
            {
                "bos_token_id": t.token_to_id("<|begin_of_text|>"),
                "eos_token_id": [t.token_to_id("<|end_of_text|>"), t.token_to_id("<|eot_id|>")],
            }
            if tokenizer == "llama3"
            else {"eos_token_id": [t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")]}
        )
    torch.manual_seed(seed)
    cls: Any
    if kind == "llama3":
        cfg: Any = LlamaConfig(
            **COMMON,
            **special,
            vocab_size=vocab_size or tok_size,
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
        cfg = Qwen2Config(
            **COMMON, **special, vocab_size=vocab_size or tok_size + 3, tie_word_embeddings=True
        )
        cls = Qwen2ForCausalLM
    elif kind in FAMILY_CONFIGS:
        name, fields = FAMILY_CONFIGS[kind]
        cfg = getattr(transformers, f"{name}Config")(
            **{**COMMON, **special, **fields}, vocab_size=vocab_size or tok_size + 3
        )
        cls = getattr(transformers, f"{name}ForCausalLM")
    else:
        raise ValueError(kind)
    model = cls(cfg).float()
    with torch.no_grad():  # biases and norms start at 0 / 1: make them random so the mapping is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".gate.weight") or "shared_expert_gate" in name:
                p.normal_(0.0, 0.5)  # routers: clear preferences, far from ties between experts
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3", {"head_dim": 24, "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen3Moe", {**MOE, "head_dim": 24, "norm_topk_prob": True, "tie_word_embeddings": False}),
    "mixtral": (
        "Mixtral",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        {
            **MOE,
            "norm_topk_prob": False,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
            "tie_word_embeddings": False,
        },
    ),
}
"""kind -> (transformers class prefix, config fields beyond COMMON) of the Qwen3 and MoE test models."""


def hf_logits(model_dir: Path, tokens: list[list[int]]) -> Any:
    """transformers' fp32 logits [b, s, V] on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()
