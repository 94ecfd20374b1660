"""Hugging Face <-> megatron weights: one table of names and transforms, streamed per rank, exact both ways.

``TABLE`` maps each megatron (local layer spec) parameter to the Hugging Face tensors it is made of and a
transform. A transform knows both directions:

- import (``load_hf``): every rank reads from the safetensors shards only the rows/columns of its own
  tensor-parallel slice (``safe_open(...).get_slice``), for the layers of its own pipeline stage (global layer
  number = ``layer.layer_number - 1``), and copies them into its parameters. Peak host memory: the rank's
  own shard plus one tensor slice.
- export (``to_hf_tensors``): a full (TP=1) megatron state dict -> Hugging Face tensors, one at a time.

Transforms: ``copy`` (replicated norms), ``row`` (row-parallel: split the input dim), ``vocab`` (embedding /
output rows split over TP, padded with zero rows up to megatron's padded vocabulary, unpadded on export),
``qkv`` (q, k, v interleaved per query group as megatron's fused projection wants: per group the group's
query heads, then its key head, then its value head; TP splits whole groups), ``gate_up`` (SwiGLU gate and
up fused in ``linear_fc1``, each half split over TP). Import then export is the identity, bit for bit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.schema.config import ModelConfig

L = "{L}"

TABLE: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",), "copy"),
    (
        "decoder.layers.{L}.self_attention.linear_qkv.weight",
        tuple(f"model.layers.{{L}}.self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    (
        "decoder.layers.{L}.self_attention.linear_qkv.bias",
        tuple(f"model.layers.{{L}}.self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv",
    ),
    (
        "decoder.layers.{L}.self_attention.linear_proj.weight",
        ("model.layers.{L}.self_attn.o_proj.weight",),
        "row",
    ),
    (
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
        ("model.layers.{L}.post_attention_layernorm.weight",),
        "copy",
    ),
    (
        "decoder.layers.{L}.mlp.linear_fc1.weight",
        ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"),
        "gate_up",
    ),
    ("decoder.layers.{L}.mlp.linear_fc2.weight", ("model.layers.{L}.mlp.down_proj.weight",), "row"),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
)
"""(megatron name, Hugging Face names, transform); ``{L}`` is the global layer number."""


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(name).replace(re.escape(L), r"(\d+)") + "$")


_PATTERNS = [(_pattern(m), m, h, t) for m, h, t in TABLE]


@dataclass(frozen=True)
class Shapes:
    """What the transforms need to know about the model."""

    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    """The real vocabulary (config.json's vocab_size)."""
    padded_vocab: int
    tp: int = 1
    tp_rank: int = 0

    @classmethod
    def of(cls, model: ModelConfig, padded_vocab: int, tp: int = 1, tp_rank: int = 0) -> Shapes:
        if model.vocab_size is None:
            raise ValueError("model.vocab_size: must be set for Hugging Face conversion")
        heads = model.num_attention_heads
        return cls(
            heads=heads,
            groups=model.num_query_groups or heads,
            head_dim=model.kv_channels or model.hidden_size // heads,
            ffn=model.ffn_hidden_size or 4 * model.hidden_size,
            vocab=model.vocab_size,
            padded_vocab=padded_vocab,
            tp=tp,
            tp_rank=tp_rank,
        )


def match(mcore_name: str) -> tuple[tuple[str, ...], str, int | None]:
    """(Hugging Face names with the layer filled in, transform, global layer) for a TP=1/PP=1 megatron name."""
    for pat, _, hf_names, kind in _PATTERNS:
        m = pat.match(mcore_name)
        if m:
            layer = int(m.group(1)) if m.groups() else None
            return tuple(h.replace(L, str(layer)) for h in hf_names), kind, layer
    raise KeyError(f"{mcore_name}: no Hugging Face mapping for this megatron parameter")


# ---------------------------------------------------------------------------- reading shards


class ShardReader:
    """Lazy access to the tensors of a Hugging Face directory's safetensors shards (one handle per file)."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
            for f in sorted(self.dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    weight_map |= {k: f.name for k in h.keys()}  # noqa: SIM118
        if not weight_map:
            raise FileNotFoundError(f"{self.dir}: no safetensors weights (model*.safetensors)")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def slice(self, name: str) -> Any:
        """A safetensors slice: ``get_shape()``, and indexing reads only the selected rows/columns."""
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} not in the checkpoint")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.dir / file), framework="pt")
        return self._handles[file].get_slice(name)


# ---------------------------------------------------------------------------- transforms: import


def _rows(sl: Any, start: int, stop: int) -> torch.Tensor:
    return sl[start:stop] if len(sl.get_shape()) == 1 else sl[start:stop, :]


def _import(kind: str, slices: list[Any], s: Shapes) -> torch.Tensor:
    """This TP rank's megatron tensor from the Hugging Face slices (reads only what it owns)."""
    r, tp = s.tp_rank, s.tp
    if kind == "copy":
        return slices[0][:]
    if kind == "row":
        cols = slices[0].get_shape()[1] // tp
        return slices[0][:, r * cols : (r + 1) * cols]
    if kind == "vocab":
        n = s.padded_vocab // tp
        lo, hi = r * n, min((r + 1) * n, s.vocab)
        part = slices[0][lo:hi, :] if hi > lo else None
        hidden = slices[0].get_shape()[1]
        out = torch.zeros(n, hidden, dtype=part.dtype if part is not None else torch.float32)
        if part is not None:
            out[: hi - lo] = part
        return out
    if kind == "gate_up":
        f = s.ffn // tp
        return torch.cat([_rows(sl, r * f, (r + 1) * f) for sl in slices])
    if kind == "qkv":
        g = s.groups // tp  # query groups on this rank
        per = s.heads // s.groups  # query heads per group
        d = s.head_dim
        q = _rows(slices[0], r * g * per * d, (r + 1) * g * per * d)
        k = _rows(slices[1], r * g * d, (r + 1) * g * d)
        v = _rows(slices[2], r * g * d, (r + 1) * g * d)
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], 1)
        return fused.reshape(g * (per + 2) * d, *tail)
    raise ValueError(f"unknown transform {kind!r}")


# ---------------------------------------------------------------------------- transforms: export


def _export(kind: str, full: torch.Tensor, s: Shapes) -> list[torch.Tensor]:
    """Hugging Face tensors from a full (TP=1) megatron tensor."""
    if kind in ("copy", "row"):
        return [full]
    if kind == "vocab":
        return [full[: s.vocab]]
    if kind == "gate_up":
        return [full[: s.ffn], full[s.ffn :]]
    if kind == "qkv":
        per, d, g = s.heads // s.groups, s.head_dim, s.groups
        tail = full.shape[1:]
        grouped = full.reshape(g, (per + 2) * d, *tail)
        q, k, v = grouped.split([per * d, d, d], dim=1)
        return [t.reshape(-1, *tail) for t in (q, k, v)]
    raise ValueError(f"unknown transform {kind!r}")


def to_hf_tensors(
    state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], model: ModelConfig, padded_vocab: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for each full TP=1/PP=1 megatron tensor of ``state`` (a state dict or a
    stream of (global megatron name, tensor) pairs, e.g. convert.hf_export.iter_checkpoint_tensors), in order."""
    s = Shapes.of(model, padded_vocab)
    for name, tensor in state.items() if isinstance(state, dict) else state:
        if name.endswith("_extra_state") or tensor is None:
            continue
        if name == "output_layer.weight" and model.tie_embeddings:
            continue
        hf_names, kind, _ = match(name)
        for hf_name, t in zip(hf_names, _export(kind, tensor, s), strict=True):
            yield hf_name, t.contiguous()


def iter_hf_tensors(hf_dir: Path, model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron name, full TP=1 tensor, vocabulary unpadded) of a Hugging Face directory, layer by
    layer, one tensor in memory at a time; entries the directory does not hold (a Llama's qkv bias, the
    lm_head of tied embeddings) are skipped."""
    reader = ShardReader(hf_dir)
    s = Shapes.of(model, model.vocab_size or 0)
    outer = [e for e in TABLE if L not in e[0]]
    per_layer = [e for e in TABLE if L in e[0]]
    plan = [(outer[0], None)] + [(e, i) for i in range(model.num_layers) for e in per_layer]
    for (name, hf_names, kind), layer in plan + [(e, None) for e in outer[1:]]:
        key = str(layer)
        names = tuple(h.replace(L, key) for h in hf_names)
        if all(h in reader for h in names):
            yield name.replace(L, key), _import(kind, [reader.slice(h) for h in names], s)


# ---------------------------------------------------------------------------- loading into the engine's model


def _global_name(chunk: Any, local_name: str) -> str:
    """``decoder.layers.<local i>.x`` -> ``decoder.layers.<global layer>.x`` for this chunk."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", local_name)
    if not m:
        return local_name
    layer = chunk.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"


def load_hf(chunks: list[Any], hf_dir: Path, model: ModelConfig) -> int:
    """Copy the Hugging Face weights into this rank's model chunks (its own TP slices and PP layers).

    Returns the number of values read. Raises naming the tensor when a parameter has no source or a
    shape does not match.
    """
    from engine.models.gpt import unwrap
    from engine.runtime import distributed as D

    reader = ShardReader(hf_dir)
    read = 0
    for chunk in chunks:
        gpt = unwrap(chunk)
        cfg = gpt.config
        padded = gpt.vocab_size
        s = Shapes.of(model, padded, tp=cfg.tensor_model_parallel_size, tp_rank=D.tp_rank())
        with torch.no_grad():
            for local_name, param in gpt.named_parameters():
                name = _global_name(gpt, local_name)
                if name.endswith((".lora_a", ".lora_b")):
                    continue  # LoRA adapters (engine/models/lora.py) start from their own init
                hf_names, kind, _ = match(name)
                if name == "output_layer.weight" and (model.tie_embeddings or hf_names[0] not in reader):
                    if not model.tie_embeddings:
                        raise KeyError(f"{hf_dir}: lm_head.weight missing but tie_word_embeddings is false")
                    hf_names = ("model.embed_tokens.weight",)
                value = _import(kind, [reader.slice(h) for h in hf_names], s)
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{hf_dir}: {'+'.join(hf_names)} gives {tuple(value.shape)} for {name} "
                        f"(tp rank {s.tp_rank}), the model has {tuple(param.shape)}"
                    )
                param.data.copy_(value.to(param.dtype))
                read += value.numel()
    return read


def full_state_dict(chunk: Any) -> dict[str, torch.Tensor]:
    """The parameters of a TP=1/PP=1 model by global megatron name (for export)."""
    from engine.models.gpt import unwrap

    gpt = unwrap(chunk)
    return {_global_name(gpt, n): p.detach() for n, p in gpt.named_parameters()}
