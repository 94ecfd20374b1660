"""What each logged step measures besides the loss: time split, achieved TFLOP/s and MFU, memory.

``StepMeter.time(part)`` accumulates wall time per part of a step (``data``, ``fwd_bwd``, ``optimizer``,
``checkpoint``); ``fields(steps, compute_s)`` returns the extra keys of a ``train`` metrics line over the
steps since the last line, then starts a new window:

- ``time_<part>_s``: mean seconds per step of each part;
- ``tflops``: achieved model TFLOP/s of the whole job (model FLOPs of one step, the planner's
  ``step_flops``, x steps / compute time); ``mfu``: tflops / (peak_tflops x world size);
- ``mem_alloc_gb`` / ``mem_reserved_gb`` (CUDA max allocated / reserved on this rank, then reset) or
  ``mem_rss_gb`` (CPU resident set size of this rank's process).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PARTS = ("data", "fwd_bwd", "optimizer", "checkpoint")
GiB = 1024**3


class StepMeter:
    def __init__(
        self, flops_per_step: float | None = None, peak_tflops: float | None = None, world_size: int = 1
    ):
        self.flops_per_step = flops_per_step
        """Model FLOPs of one optimizer step of the whole job (None: no TFLOP/s, no MFU)."""
        self.peak_tflops = peak_tflops
        """Peak TFLOP/s of one rank's device (None: no MFU)."""
        self.world_size = world_size
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    @contextmanager
    def time(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - t0

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def fields(self, steps: int, compute_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {f"time_{k}_s": v / max(steps, 1) for k, v in self.parts.items()}
        self.parts = dict.fromkeys(PARTS, 0.0)
        if self.flops_per_step and compute_s > 0:
            tflops = self.flops_per_step * steps / compute_s / 1e12
            out["tflops"] = tflops
            if self.peak_tflops:
                out["mfu"] = tflops / (self.peak_tflops * self.world_size)
        out.update(memory())
        return out


def memory() -> dict[str, float]:
    """This rank's memory: CUDA max allocated/reserved since the last call (GiB), else the process RSS."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out = {
            "mem_alloc_gb": torch.cuda.max_memory_allocated() / GiB,
            "mem_reserved_gb": torch.cuda.max_memory_reserved() / GiB,
        }
        torch.cuda.reset_peak_memory_stats()
        return out
    import psutil

    return {"mem_rss_gb": psutil.Process().memory_info().rss / GiB}


CPU_PEAK_TFLOPS = 0.15
"""Default peak of one CPU rank (fp32 matmul, 2 threads), measured by bench/bench_matmul.py on the 2-core
development machine; cluster.peak_tflops overrides it."""
