"""What keeping freed host memory (engine.runtime.host_memory) gives a CPU training step: faults and speed.

    python -m bench.bench_host_memory [--reps 5] [--steps 16] [--warmup 3] [--shapes 4.4x]

Pairs of fresh processes at bench/bench_attention.py's shapes, the two of a pair at the same time, one
thread each, each pinned to a core of its own (swapped every other pair; bench_attention.side_by_side),
so both meet the same moments of other load: the engine as it runs (``D.init`` keeps freed memory)
beside the engine with glibc's defaults (the environment names a malloc tunable at its default value,
so the engine leaves the allocator alone); nanoGPT with the engine's thresholds (given through glibc's
own ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) beside nanoGPT as written; the engine beside
nanoGPT, both with memory kept. Prints, per pair, the median (min, max) of the pairs' speed ratios and
the median minor page faults per step of each side. Needs two cores and glibc.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from engine.runtime import host_memory

GLIBC_DEFAULT = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
"""A malloc tunable at glibc's default value: the allocator is as glibc starts it, and the engine, seeing
the environment choose, does not change it."""
KEPT = {
    "MALLOC_MMAP_THRESHOLD_": str(host_memory.MMAP_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(host_memory.TRIM_BYTES),
}
"""The engine's thresholds through glibc's environment (for nanoGPT, which does not set them itself)."""
PAIRS: dict[str, tuple[tuple[str, dict[str, str]], tuple[str, dict[str, str]]]] = {
    "engine kept / engine default": (("engine", {}), ("engine", GLIBC_DEFAULT)),
    "nanoGPT kept / nanoGPT default": (("nanogpt", KEPT), ("nanogpt", {})),
    "engine / nanoGPT, both kept": (("engine", {}), ("nanogpt", KEPT)),
}


def run_pair(pair: str, shape: str, rep: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """Speed ratio (first / second, median step times) and the two sides' median minor faults per step."""
    from bench import bench_attention as BA

    (mode_a, env_a), (mode_b, env_b) = PAIRS[pair]
    model = {**BA.SHAPES[shape], "attention_backend": "sdpa"}
    a, b = BA.side_by_side(BA._spec(mode_a, model, args), BA._spec(mode_b, model, args), rep, env_a, env_b)
    ratio = statistics.median(b["step_times"]) / statistics.median(a["step_times"])
    return ratio, statistics.median(a["minor_faults"]), statistics.median(b["minor_faults"])


def main(argv: list[str] | None = None) -> int:
    from bench import bench_attention as BA

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    BA.add_run_arguments(p, reps=5)
    p.add_argument("--shapes", default="4.4x")
    p.set_defaults(threads=1)  # bench_attention._spec's; side_by_side runs one thread a side
    args = p.parse_args(argv)
    if not host_memory._glibc() or not BA.two_cores():
        print("bench_host_memory: needs glibc's malloc and two cores; skipped")
        return 0
    from bench.bench_throughput import warn_if_busy

    warn_if_busy()
    for shape in args.shapes.split(","):
        for pair in PAIRS:
            runs = [run_pair(pair, shape, rep, args) for rep in range(args.reps)]
            fa, fb = statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)
            print(
                f"{shape:>5} side by side, one core each, {args.reps} pairs: {pair} "
                f"{BA._spread([r[0] for r in runs])}; minor faults per step {fa:,.0f} / {fb:,.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
