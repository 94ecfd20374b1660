"""Initial weights that do not depend on the layout: every parameter drawn by its global name.

megatron-core seeds each pipeline stage differently (``distributed.set_seed`` adds an offset per stage, as
megatron does for dropout), so the same config started at pp=1 and at pp=2 used to begin from different
weights. Here every randomly initialised parameter is drawn again, after the model is built, from a
generator seeded by ``(seed, global parameter name)``, where the name carries the global layer number
(``decoder.layers.<global>.…``): the same tensor at any TP / PP / VPP / DP layout. A tensor-parallel shard
is the slice of the full tensor that megatron's own CPU initialisation would give this rank (same split,
same stride; drawn on the parameter's device, so CPU and GPU runs each agree across their layouts). The
distributions stay megatron's: ``config.embedding_init_method`` for embeddings,
``config.output_layer_init_method`` for the projections into the residual stream (``linear_proj``,
``linear_fc2``), ``config.init_method`` for the other weights. Constant parameters (norm weights, biases:
ones or zeros) are already layout-invariant and left alone. The vocabulary tables (embedding, output layer)
are drawn with the real vocabulary's rows and padded with zero rows, so the padding, which grows with tp,
never changes the real rows (the padded entries are masked out of the logits: engine/models/gpt.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

import torch

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")
_RESIDUAL_OUT = (".linear_proj.weight", ".linear_fc2.weight")
_TIED_EMBEDDING = "embedding.word_embeddings.weight"
_VOCAB_TABLES = (_TIED_EMBEDDING, "output_layer.weight")


def global_name(model: Any, name: str) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<global, 0-based>.x``, a MoE layer's local expert
    ``mlp.experts.local_experts.<i>.x`` (or Transformer Engine's grouped ``mlp.experts.linear_fc1.weight<i>``)
    -> ``mlp.experts.local_experts.<global expert>.x``; the tied output layer of a later pipeline stage is
    the word embedding."""
    m = _LOCAL_LAYER.match(name)
    if m:
        layer = model.decoder.layers[int(m.group(1))]
        return f"decoder.layers.{int(layer.layer_number) - 1}.{_expert_name(layer, m.group(2))}"
    if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
        return _TIED_EMBEDDING
    return name


def _expert_name(layer: Any, rest: str) -> str:
    """``rest`` (a name inside one layer) with a local expert's index made global (megatron's MoELayer: local
    expert i of expert-parallel rank r is global expert r x experts / ep + i)."""
    m = _SEQUENTIAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
    if not m:
        return rest
    local, tail = (
        (int(m.group(1)), m.group(2)) if m.re is _SEQUENTIAL_EXPERT else (int(m.group(2)), m.group(1))
    )
    return f"mlp.experts.local_experts.{int(layer.mlp.local_expert_indices[local])}.{tail}"


def is_expert(gname: str) -> bool:
    """Whether a global parameter name is a routed expert's (split over expert tensor parallel ranks)."""
    return ".mlp.experts." in gname


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a global parameter name."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big") >> 1


def _init_method(config: Any, name: str) -> Callable[..., Any]:
    if name.startswith("embedding."):
        return config.embedding_init_method or config.init_method
    if name.endswith(_RESIDUAL_OUT):
        return config.output_layer_init_method
    return config.init_method


def _tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of ``full``, split like megatron's ``_initialize_affine_weight_cpu``."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    # partition_dim: set on the tensor by megatron's tensor-parallel layers (torch's stub lacks it)
    dim, stride = int(param.partition_dim), int(getattr(param, "partition_stride", 1))  # type: ignore[attr-defined]
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def _draw(init: Callable[..., Any], shape: list[int], gen: torch.Generator, rows: int | None) -> torch.Tensor:
    """A full fp32 tensor drawn by ``init``; with ``rows``: those first rows drawn, the rest zeros (padding)."""
    full = torch.empty(shape, dtype=torch.float32, device=gen.device)  # drawn where it lives
    if rows is None or rows >= shape[0]:
        init(full, generator=gen)
        return full
    full[rows:] = 0
    init(full[:rows], generator=gen)
    return full


@torch.no_grad()
def init_by_global_name(
    model: Any,
    config: Any,
    seed: int,
    tp_rank: int,
    tp_size: int,
    vocab_size: int | None = None,
    expert_tp: tuple[int, int] = (0, 1),
) -> int:
    """Redraw every random parameter of one GPTModel chunk by its global name; returns how many.

    ``vocab_size``: the real vocabulary (rows of the vocabulary tables drawn; None: all rows, padding too).
    ``expert_tp``: (rank, size) of expert tensor parallelism, which splits the routed experts' linears.
    """
    redrawn = 0
    for name, param in model.named_parameters():
        gname = global_name(model, name)
        if gname != _TIED_EMBEDDING and (param.numel() < 2 or bool((param == param.reshape(-1)[0]).all())):
            continue  # constant: norm weights and biases (ones or zeros)
        rank, size = expert_tp if is_expert(gname) else (tp_rank, tp_size)
        shape = list(param.shape)
        if size > 1 and getattr(param, "tensor_model_parallel", False):
            shape[int(param.partition_dim)] *= size
        gen = torch.Generator(device=param.device).manual_seed(param_seed(seed, gname))
        rows = vocab_size if gname in _VOCAB_TABLES else None
        full = _draw(_init_method(config, gname), shape, gen, rows)
        param.copy_(_tp_slice(full, param, rank, size).to(param.dtype))
        redrawn += 1
    return redrawn
