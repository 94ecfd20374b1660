"""Core attention on PyTorch's fused ``scaled_dot_product_attention`` for the local (non-TE) layer spec.

``SDPAttention`` replaces megatron's unfused ``DotProductAttention`` (baddbmm -> masked softmax -> bmm, one
[b, heads, s, s] score tensor materialized per layer) and keeps its interface, parameters and checkpoint
keys: it subclasses it and only swaps ``forward``. Semantics, equal to the unfused module within fp32
tolerance (tests/engine/models/test_attention.py):

- ``attention_mask`` None: causal (``is_causal``). Given (megatron's convention: bool, True = masked out,
  broadcastable to [b, 1, s, s]), it is used as is and the causal mask type is not added; this is how packed
  sequences get a block-diagonal causal mask (``block_causal_mask``).
- Grouped-query attention: key/value heads are shared by ``heads / groups`` query heads (``enable_gqa``,
  no copies). Tensor parallel: the module sees its partition's heads, like the unfused one.
- Dropout on attention probabilities under megatron's model-parallel RNG tracker, as the unfused module.
- Softmax scale: megatron's (1/sqrt(head dim), divided by the layer number with query-key layer scaling).

``RotatedCacheSelfAttention`` (every spec, ``set_self_attention``): megatron's SelfAttention whose static KV
cache holds keys already rotated by RoPE. megatron's static-batching path caches unrotated keys and rotates
the whole cache again in every layer at every decode step (cost growing with the sequence: most of a decode
step's time on CPU); its dynamic path and flash decoding rotate each key once, before caching, as this does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config as rope_mscale,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention

BACKENDS = ("auto", "sdpa", "unfused")


class SDPAttention(DotProductAttention):
    """megatron's DotProductAttention with the fused kernel of ``torch.nn.functional.scaled_dot_product_attention``."""

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPAttention: packed_seq_params / attention_bias need Transformer Engine; packed sequences "
                "here use a block-diagonal attention_mask (engine.models.attention.block_causal_mask)"
            )
        sq, b, heads, dim = query.shape
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask.to(torch.bool)
        dropout = self.attention_dropout.p if self.training else 0.0
        kwargs = {
            "attn_mask": mask,
            "is_causal": mask is None and sq > 1,
            "scale": self.softmax_scale,
            "enable_gqa": k.shape[1] != heads,
        }
        if dropout and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kwargs)
        # [b, n, s, d] -> [s, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Attention mask for packed rows, megatron's convention (bool [b, 1, s, s], True = masked out).

    ``segment_ids`` [b, s] numbers the examples of each row; a token attends to earlier tokens of its own
    example only (causal within the example, nothing across examples).
    """
    s = segment_ids.shape[-1]
    other = segment_ids[:, :, None] != segment_ids[:, None, :]
    future = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).triu(1)
    return (other | future).unsqueeze(1)


def core_attention_class(backend: str) -> type:
    """The core attention module of the local spec for ``model.attention_backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"model.attention_backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    return DotProductAttention if backend == "unfused" else SDPAttention


class RotatedCacheSelfAttention(SelfAttention):
    """megatron's SelfAttention; with a static inference context the new keys (and the queries, at the same
    positions) are rotated before the keys enter the KV cache (the module docstring)."""

    def _adjust_key_value_for_inference(  # type: ignore[override]
        self,
        inference_context: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rotary_pos_emb: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        static = inference_context is not None and inference_context.is_static_batching()
        if not static or rotary_pos_emb is None or self.config.flash_decode:
            return super()._adjust_key_value_for_inference(
                inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
            )
        q_emb, k_emb = rotary_pos_emb
        start = inference_context.sequence_len_offset
        together = q_emb is k_emb  # self attention: queries and keys at the same positions, one rotation
        if together:
            both = self._rotate(torch.cat((query, key), dim=2), k_emb, start)
            query, key = both[:, :, : query.size(2)], both[:, :, query.size(2) :]
        else:
            key = self._rotate(key, k_emb, start)
        query, key, value, (q_emb, _), mask_type, table = super()._adjust_key_value_for_inference(
            inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
        )
        return query, key, value, (None if together else q_emb, None), mask_type, table

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor, start: int) -> torch.Tensor:
        """RoPE of ``t`` [s, b, heads, dim] at positions start.. (megatron's unfused or fused kernel)."""
        return apply_rotary_pos_emb(
            t,
            freqs[start : start + t.size(0)],
            config=self.config,
            mscale=rope_mscale(self.config),
            cp_group=self.pg_collection.cp,
        )


def set_self_attention(spec: Any) -> None:
    """Put ``RotatedCacheSelfAttention`` into a layer spec whose self attention is megatron's SelfAttention."""
    if spec.submodules.self_attention.module is SelfAttention:
        spec.submodules.self_attention.module = RotatedCacheSelfAttention
