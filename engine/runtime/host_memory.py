"""Host memory of a CPU training process: freed tensors' memory kept in the heap and reused without faults.

glibc's malloc gives the top of its heap back to the kernel once more of it is free than its trim
threshold, a threshold that adapts (to twice the largest block it ever unmapped, at most 64 MiB). A
training step frees and allocates the same activations every step, so a step can give back tens of MiB
of heap and fault them in again the next (a stalled thread holds its OpenMP peers at the next barrier;
bench/bench_host_memory.py counts the faults, docs/benchmarks.md has the figures). ``keep_freed_memory`` fixes the trim threshold at
``TRIM_BYTES`` and the mmap threshold at ``MMAP_BYTES``: after the first steps the heap holds the step's
peak and every step reuses it (resident memory stays at that peak, which each step reaches again anyway).

Only with glibc, and only when the environment does not choose already (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES`` with a ``glibc.malloc`` tunable, or a preloaded allocator
such as jemalloc or tcmalloc through ``LD_PRELOAD``). engine.runtime.distributed.init calls it on CPU
only: with CUDA the tensors live in the CUDA caching allocator.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_BYTES = 1 << 30
"""Free memory at the top of the heap up to 1 GiB is kept (glibc's adaptive threshold stops at 64 MiB)."""
MMAP_BYTES = 32 << 20
"""Blocks below 32 MiB come from the heap (where glibc's adaptive threshold ends; it starts at 128 KiB).
Larger blocks stay mappings of their own: a higher fixed threshold fragments the heap."""

_CHOSEN_BY_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def chosen_by_environment(environ: Mapping[str, str]) -> str | None:
    """The variable through which the environment already sets the allocator up, or None."""
    for key in _CHOSEN_BY_ENV:
        if key in environ:
            return key
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD"
    return None


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Fix glibc malloc's trim and mmap thresholds (``TRIM_BYTES``, ``MMAP_BYTES``) for this process, for
    the rest of its life. Returns whether it did: False without glibc or when the environment chose."""
    environ = os.environ if environ is None else environ
    if chosen_by_environment(environ) or not _glibc():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))


def _glibc() -> bool:
    """True when this process's C library is glibc."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # type: ignore[union-attr]
    except (ValueError, OSError, AttributeError):
        return False
