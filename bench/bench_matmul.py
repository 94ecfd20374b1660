"""Peak matmul TFLOP/s of this machine's device: the MFU denominator for CPU runs (cluster.peak_tflops).

    python -m bench.bench_matmul [--size 1024] [--threads 2] [--dtype float32] [--reps 10]

Times ``torch.mm`` of two ``size x size`` matrices (2 size^3 FLOPs each) after a warm-up and prints the best
of ``--reps`` as TFLOP/s, next to a baseline run in the same script (a 4x smaller matrix, which bounds how
far the big one is from its own compute limit) and to engine.train.meter.CPU_PEAK_TFLOPS, the default
peak of one CPU rank (set cluster.peak_tflops to the figure printed here on another machine). With CUDA it
also runs bf16 on the GPU.
"""

from __future__ import annotations

import argparse
import time


def tflops(size: int, dtype: str, device: str, reps: int) -> float:
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(size, size, dtype=dt, device=device)
    b = torch.randn(size, size, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def main() -> None:
    import torch

    from engine.train.meter import CPU_PEAK_TFLOPS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = tflops(a.size // 4, a.dtype, "cpu", a.reps)
    big = tflops(a.size, a.dtype, "cpu", a.reps)
    print(f"cpu {a.dtype} {a.threads} threads: {a.size // 4}^3 {base:.4f} TFLOP/s (baseline)")
    print(
        f"cpu {a.dtype} {a.threads} threads: {a.size}^3 {big:.4f} TFLOP/s  ratio {big / base:.2f}x baseline"
    )
    print(
        f"engine.train.meter.CPU_PEAK_TFLOPS = {CPU_PEAK_TFLOPS}: measured/default {big / CPU_PEAK_TFLOPS:.2f}"
    )
    if torch.cuda.is_available():
        gpu = tflops(8192, "bfloat16", "cuda", a.reps)
        print(f"cuda bfloat16 8192^3: {gpu:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
