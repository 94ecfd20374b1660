"""First-save cost of the checkpoint writer's results-queue manager: spawned (megatron's default, and ours
before) against forked (``engine.checkpoint.writer.signal_safe_writer_queue`` now).

Each repetition starts a manager and round-trips one torch WriteResult through its queue (what the first
save does), interleaved; prints the medians and their ratio. ``python -m bench.bench_writer_helper [--reps 5]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.managers import SyncManager

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult


def _init() -> None:
    pass


def first_use(method: str) -> float:
    t0 = time.perf_counter()
    manager = SyncManager(ctx=mp.get_context(method))
    manager.start(initializer=_init)
    queue = manager.Queue()
    queue.put({0: [WriteResult(index=MetadataIndex("x"), size_in_bytes=1, storage_data=None)]})
    queue.get()
    elapsed = time.perf_counter() - t0
    manager.shutdown()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    reps = ap.parse_args().reps
    times: dict[str, list[float]] = {"spawn": [], "fork": []}
    for _ in range(reps):
        for method in times:
            times[method].append(first_use(method))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:5s} manager, first save's extra cost: median {v:.3f} s over {reps}")
    print(f"ratio spawn/fork: {med['spawn'] / med['fork']:.0f}x")


if __name__ == "__main__":
    main()
