"""engine.runtime.host_memory: a CPU job's freed tensor memory stays in the heap and is reused without faults.

The allocator's thresholds are process-wide and for the process's life, so each case runs in a fresh
subprocess. It holds eight 4 MiB tensors at once, frees them, and reports (glibc's ``mallinfo2``) how many
of those bytes were fresh mappings while alive and how much heap is still held after the free, then the
minor page faults of ten more rounds. With glibc's defaults a fresh process maps every block above 128
KiB on its own (and unmaps it on free); with the memory kept the blocks come from the heap and stay there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.runtime import host_memory
from tests.support.env import REPO as ROOT
from tests.support.timing import scaled

BLOCKS = 8 * (4 << 20)

_PROBE = """
import ctypes, json, resource, sys, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks "
                                               "uordblks fordblks keepcost").split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
how = sys.argv[1]
kept = None
if how == "keep":
    from engine.runtime import host_memory
    kept = host_memory.keep_freed_memory()
elif how == "init":
    from engine.runtime import distributed as D
    D.init(threads=1)
def blocks():
    return [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(8)]
base = libc.mallinfo2()
live = blocks()
mapped = libc.mallinfo2().hblkhd - base.hblkhd
del live
held = libc.mallinfo2().arena - base.arena
for _ in range(5):  # the heap settles (aligned blocks may not fit the holes of the first rounds)
    blocks()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    blocks()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
if how == "init":
    D.shutdown()
print(json.dumps({"kept": kept, "mapped": mapped, "held": held, "faults": faults}))
"""


def _probe(how: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for k in ("GLIBC_TUNABLES", "LD_PRELOAD", "WORLD_SIZE", "RANK", "MASTER_PORT", "MASTER_ADDR"):
        environ.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, how], cwd=ROOT, env={**environ, **env},
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


needs_glibc = pytest.mark.skipif(not host_memory._glibc(), reason="glibc's malloc only")


@needs_glibc
def test_glibc_defaults_map_each_block_and_give_it_back() -> None:
    """The baseline the probe tells apart: with the defaults the blocks are mappings, none stays held."""
    out = _probe("default")
    assert out["mapped"] >= BLOCKS, out
    assert out["held"] < BLOCKS // 4, out


@needs_glibc
def test_kept_memory_stays_in_the_heap_and_is_reused_without_faults() -> None:
    out = _probe("keep")
    assert out["kept"] is True
    assert out["mapped"] < BLOCKS // 8, out
    assert out["held"] >= BLOCKS // 2, out
    assert out["faults"] < (BLOCKS // 4096) // 10, out  # ten rounds reuse the held pages


@needs_glibc
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU jobs only (with CUDA the caching allocator)")
def test_a_cpu_job_keeps_its_memory() -> None:
    """engine.runtime.distributed.init sets it up for every CPU job (one rank, gloo)."""
    out = _probe("init")
    assert out["mapped"] < BLOCKS // 8 and out["held"] >= BLOCKS // 2, out


@needs_glibc
def test_an_allocator_chosen_by_the_environment_is_left_alone() -> None:
    out = _probe("keep", GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert out["kept"] is False
    assert out["mapped"] >= BLOCKS and out["held"] < BLOCKS // 4, out


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": "0"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "LD_PRELOAD": " "}, None),
        ({}, None),
    ],
)
def test_chosen_by_environment_names_the_variable(environ: dict[str, str], named: str | None) -> None:
    assert host_memory.chosen_by_environment(environ) == named
    if named:
        assert host_memory.keep_freed_memory(environ) is False
