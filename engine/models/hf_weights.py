"""Hugging Face <-> megatron weights: per-family tables of names and transforms, streamed per rank, exact both ways.

engine/models/hf_tables.py maps each megatron (local layer spec) parameter to the Hugging Face tensors it is
made of and a transform, one table per family layout. A transform knows both directions:

- import (``load_hf``): every rank reads from the safetensors shards only the rows/columns of its own
  tensor-parallel slice (``safe_open(...).get_slice``), for the layers of its own pipeline stage (global layer
  number = ``layer.layer_number - 1``) and, in MoE layers, for its own experts only (global expert index =
  ``mlp.local_expert_indices``: an expert-parallel rank never reads another rank's experts), and copies them
  into its parameters. Peak host memory: the rank's own shard plus one tensor slice.
- export (``to_hf_tensors``): a full (TP=1, EP=1) megatron state dict -> Hugging Face tensors, one at a time.

Transforms: ``copy`` (replicated norms, routers, the shared expert's gate), ``row`` (row-parallel: split the
input dim), ``vocab`` (embedding / output rows split over TP, padded with zero rows up to megatron's padded
vocabulary, unpadded on export), ``qkv`` (q, k, v interleaved per query group as megatron's fused projection
wants: per group the group's query heads, then its key head, then its value head; TP splits whole groups),
``gate_up`` (SwiGLU gate and up fused in ``linear_fc1``, each half split over TP), ``expert_gate_up`` /
``expert_row`` (the same for one routed expert, split over expert tensor parallelism, etp), ``shared_gate_up``
(the shared expert's fc1, its own width, split over TP). Import then export is the identity, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.hf_tables import E, L, Row, fill, match, table_for, table_of
from pipeline.schema.config import ModelConfig
from pipeline.schema.hf_arch import read_config
from pipeline.schema.moe import expert_ffn


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
    expert_ffn: int = 0
    """One routed expert's width (MoE)."""
    shared_ffn: int = 0
    """The shared expert's width (Qwen2-MoE)."""
    etp: int = 1
    etp_rank: int = 0

    @classmethod
    def of(
        cls,
        model: ModelConfig,
        padded_vocab: int,
        tp: int = 1,
        tp_rank: int = 0,
        etp: int = 1,
        etp_rank: int = 0,
    ) -> Shapes:
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
            expert_ffn=expert_ffn(model),
            shared_ffn=model.moe_shared_expert_intermediate_size or 0,
            etp=etp,
            etp_rank=etp_rank,
        )

    def split(self, kind: str) -> tuple[int, int, int]:
        """(fc1 half width, split size, this rank's place) of a gate_up or row kind."""
        if kind.startswith("expert_"):
            return self.expert_ffn, self.etp, self.etp_rank
        if kind == "shared_gate_up":
            return self.shared_ffn, self.tp, self.tp_rank
        return self.ffn, self.tp, self.tp_rank


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
    """This rank's megatron tensor from the Hugging Face slices (reads only what it owns)."""
    r, tp = s.tp_rank, s.tp
    if kind == "copy":
        return slices[0][:]
    if kind in ("row", "expert_row"):
        _, n, r = s.split(kind)
        cols = slices[0].get_shape()[1] // n
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
    if kind in ("gate_up", "expert_gate_up", "shared_gate_up"):
        width, n, r = s.split(kind)
        f = width // n
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
    if kind in ("copy", "row", "expert_row"):
        return [full]
    if kind == "vocab":
        return [full[: s.vocab]]
    if kind in ("gate_up", "expert_gate_up", "shared_gate_up"):
        width = s.split(kind)[0]
        return [full[:width], full[width:]]
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
    """(Hugging Face name, tensor) for each full TP=1/PP=1/EP=1 megatron tensor of ``state`` (a state dict or
    a stream of (global megatron name, tensor) pairs, e.g. convert.hf_export.iter_checkpoint_tensors), in
    order, named as the family ``model`` is exported as."""
    s = Shapes.of(model, padded_vocab)
    table = table_for(model)
    for name, tensor in state.items() if isinstance(state, dict) else state:
        if name.endswith("_extra_state") or tensor is None:
            continue
        if name == "output_layer.weight" and model.tie_embeddings:
            continue
        hf_names, kind, _ = match(name, table)
        for hf_name, t in zip(hf_names, _export(kind, tensor, s), strict=True):
            yield hf_name, t.contiguous()


def stream_plan(table: tuple[Row, ...], model: ModelConfig) -> Iterator[tuple[Row, int | None, int | None]]:
    """(row, layer, expert) in streaming order: the embedding, each layer's rows (each expert of an expert
    row), the final norm and output layer. A layer lacks the rows of the other kind (dense or MoE)."""
    outer = [r for r in table if L not in r[0]]
    yield outer[0], None, None
    for layer in range(model.num_layers):
        for row in (r for r in table if L in r[0]):
            for expert in range(model.num_experts or 0) if E in row[0] else [None]:
                yield row, layer, expert
    for row in outer[1:]:
        yield row, None, None


def iter_hf_tensors(hf_dir: Path, model: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron name, full TP=1 tensor, vocabulary unpadded) of a Hugging Face directory, layer by
    layer, one tensor in memory at a time; entries the directory does not hold (a Llama's qkv bias, the
    lm_head of tied embeddings, the dense MLP of a MoE layer) are skipped."""
    reader = ShardReader(hf_dir)
    s = Shapes.of(model, model.vocab_size or 0)
    table = table_of(str(read_config(hf_dir).get("model_type")))
    for (name, hf_names, kind), layer, expert in stream_plan(table, model):
        names = tuple(fill(h, layer, expert) for h in hf_names)
        if all(h in reader for h in names):
            yield fill(name, layer, expert), _import(kind, [reader.slice(h) for h in names], s)


# ---------------------------------------------------------------------------- loading into the engine's model


def _global_name(chunk: Any, local_name: str) -> str:
    """``decoder.layers.<local i>.x`` -> ``decoder.layers.<global layer>.x`` for this chunk, a local expert
    ``mlp.experts.local_experts.<i>`` -> ``...local_experts.<global expert>`` (engine.models.init_weights)."""
    from engine.models.init_weights import global_name

    return global_name(chunk, local_name) if local_name.startswith("decoder.layers.") else local_name


def load_hf(chunks: list[Any], hf_dir: Path, model: ModelConfig) -> int:
    """Copy the Hugging Face weights into this rank's model chunks (its own TP slices, PP layers and experts).

    Returns the number of values read. Raises naming the tensor when a parameter has no source or a
    shape does not match.
    """
    from engine.models.gpt import unwrap
    from engine.runtime import distributed as D

    reader = ShardReader(hf_dir)
    table = table_of(str(read_config(hf_dir).get("model_type")))
    etp, etp_rank = D.etp_size(), D.etp_rank()
    read = 0
    for chunk in chunks:
        gpt = unwrap(chunk)
        tp = gpt.config.tensor_model_parallel_size
        s = Shapes.of(model, gpt.vocab_size, tp=tp, tp_rank=D.tp_rank(), etp=etp, etp_rank=etp_rank)
        with torch.no_grad():
            for local_name, param in gpt.named_parameters():
                name = _global_name(gpt, local_name)
                if name.endswith((".lora_a", ".lora_b")):
                    continue  # LoRA adapters (engine/models/lora.py) start from their own init
                hf_names, kind, _ = match(name, table)
                if name == "output_layer.weight" and (model.tie_embeddings or hf_names[0] not in reader):
                    if not model.tie_embeddings:
                        raise KeyError(f"{hf_dir}: lm_head.weight missing but tie_word_embeddings is false")
                    hf_names = ("model.embed_tokens.weight",)
                value = _import(kind, [reader.slice(h) for h in hf_names], s)
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{hf_dir}: {'+'.join(hf_names)} gives {tuple(value.shape)} for {name} "
                        f"(tp rank {s.tp_rank}, etp rank {s.etp_rank}), the model has {tuple(param.shape)}"
                    )
                param.data.copy_(value.to(param.dtype))
                read += value.numel()
    return read


def full_state_dict(chunk: Any) -> dict[str, torch.Tensor]:
    """The parameters of a TP=1/PP=1/EP=1 model by global megatron name (for export)."""
    from engine.models.gpt import unwrap

    gpt = unwrap(chunk)
    return {_global_name(gpt, n): p.detach() for n, p in gpt.named_parameters()}
