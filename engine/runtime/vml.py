"""Exact CPU math from the first step: resolve MKL VML's kernel dispatch before any multi-threaded call.

PyTorch's CPU wheels route contiguous float unary ops (``exp``, ``log``, ``tanh``, ``sqrt``, ``sin``, ...)
to MKL's vector math library (VML), each intra-op thread calling it on its own chunk. oneMKL 2024.2 (the
build inside torch 2.13's wheels) resolves each VML function's kernel on that function's first call; when
that first call runs on several threads at once, one thread can run a low-accuracy kernel for its whole
chunk of that one call (pytorch/pytorch#188792), so two identical runs, or a run and its resume, could
drift apart (docs/fault-tolerance.md, "Exact resume on CPU", has the measurements).

``warm()`` calls every VML-backed unary op once on a tensor below ATen's parallel grain (2,048 elements),
so on one thread, for float32 and float64: the dispatch is resolved before the first parallel call.
``engine.runtime.distributed.init`` calls it in every rank. Harmless where MKL is fixed (2025.0 and
later) or absent. ``tests/engine/runtime/test_vml.py`` races fresh processes with and without it.
"""

from __future__ import annotations

import torch

OPS = (
    "acos",
    "asin",
    "atan",
    "ceil",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "expm1",
    "floor",
    "lgamma",
    "log",
    "log10",
    "log1p",
    "log2",
    "round",
    "rsqrt",
    "sigmoid",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
"""torch unary ops that ATen may hand to VML (a superset: warming one that is not costs microseconds)."""

_SIZE = 64
"""Elements of the warm-up tensor: below ATen's grain, so the call runs on the calling thread only."""


def warm() -> None:
    """Call each op of ``OPS`` once, single-threaded, in float32 and float64 (values in every op's domain)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((_SIZE,), 0.5, dtype=dtype)
        for name in OPS:
            getattr(torch, name)(x)
