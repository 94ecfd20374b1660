"""Checkpoint verification against checkpoint loading, 2 ranks, a multi-GB checkpoint.

    python -m bench.bench_verify [--gb-per-rank 1.0] [--reps 3]

Two gloo ranks each hold a tensor of ``--gb-per-rank`` GB (fp32, one shard per rank), saved once through
``engine.checkpoint.save.save`` (the real commit: checksums, marker with whole-file xxh3_128 and sampled
block hashes). Then, interleaved for ``--reps`` repetitions, the median of:

- ``verify, rank 0 alone``: ``find_latest(collective=False)`` on rank 0, every file in turn, one thread (what a
  resume did before).
- ``verify, per rank (full)``: ``find_latest`` on both ranks, each hashing the files it wrote.
- ``verify, per rank (sampled)``: the same in ``checkpoint_verify=sampled`` mode (sizes + 8 blocks per file).
- ``load``: ``checkpoint.load`` of the tensors (dist_checkpointing, both ranks), nothing hashed.
- ``verify + load``: ``checkpoint.load(verify="full")``, what a resume runs (``load_latest``): each rank hashes
  its files in a background thread while the load plans; the ranks agree on the verdict before the first
  tensor byte is read into the model.

Printed: each time, the added cost of the overlapped ``verify + load`` over ``load`` alone (median of the
per-repetition differences, over the median load), and the ratio verify / load of the sequential way
(``find_latest`` then ``load``, before); goal: verification adds <= 10% to the load. The files sit
in the page cache (just written), so both sides read memory, not disk: on a cluster filesystem, reading
dominates both. Checksum speeds of this CPU are printed too (xxh3_128, what markers record, and sha256,
what they recorded before): verification is bound by them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor

    from engine.checkpoint import integrity
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load
    from engine.checkpoint.overlap import OverlappedCheck
    from engine.checkpoint.save import save
    from engine.runtime import distributed as D

    D.init(1, 1, None, seed=1, threads=1)
    rank, world = D.rank(), D.world_size()

    class Chunk(torch.nn.Module):
        def __init__(self, numel: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(numel).uniform_(), requires_grad=False)

        def sharded_state_dict(self) -> dict[str, Any]:
            return {"w": ShardedTensor.from_rank_offsets("w", self.w.data, (0, rank, world), replica_id=0)}

        def load_state_dict(self, state: Any, strict: bool = True) -> Any:
            self.w.data.copy_(state["w"])
            return [], []  # missing, unexpected keys

    chunk = Chunk(int(spec["gb_per_rank"] * 1e9) // 4)
    root = Path(spec["root"])
    t0 = time.perf_counter()
    path = save(root, 1, model_chunks=[chunk], optimizer=None, scheduler=None, state={}, final=True)
    save_s = time.perf_counter() - t0

    def timed(fn: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def alone() -> None:  # as before: rank 0 hashes every file, one after the other
        if rank == 0:
            threads, integrity._VERIFY_THREADS = integrity._VERIFY_THREADS, 1
            try:
                assert find_latest(root, collective=False) == path
            finally:
                integrity._VERIFY_THREADS = threads

    phases: dict[str, list[float]] = {"hash": [], "before_reads": [], "waited": []}
    check_cls = OverlappedCheck
    init, gate = check_cls.__init__, check_cls.gate

    def init_timed(self: Any, *args: Any) -> None:  # when the background hashing starts and ends
        self.t0 = time.perf_counter()
        init(self, *args)
        self.future.add_done_callback(lambda _: setattr(self, "t1", time.perf_counter()))

    def gate_timed(self: Any) -> None:  # when the first read waits for the verdict
        if not self.agreed:
            t = time.perf_counter()
            self.future.result()
            phases["hash"].append(self.t1 - self.t0)
            phases["before_reads"].append(t - self.t0)
            phases["waited"].append(max(0.0, self.t1 - t))
        gate(self)

    check_cls.__init__, check_cls.gate = init_timed, gate_timed  # type: ignore[method-assign]
    cases = {
        "verify_rank0_alone": alone,
        "verify_per_rank_full": lambda: find_latest(root, mode="full"),
        "verify_per_rank_sampled": lambda: find_latest(root, mode="sampled"),
        "load": lambda: load(path, model_chunks=[chunk]),
        "verify_and_load": lambda: load(path, model_chunks=[chunk], verify="full"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(spec["reps"]):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    bytes_on_disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    D.shutdown()
    return {"save_s": save_s, "times": times, "bytes": bytes_on_disk, "phases": phases}


def hash_speed(new: Any) -> float:
    """GiB/s of one core for the hash object factory ``new``."""
    block = os.urandom(64 << 20)
    t = time.perf_counter()
    for _ in range(4):
        h = new()
        h.update(block)
        h.digest()
    return 4 * 64 / 1024 / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb-per-rank", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    args = p.parse_args(argv)
    from tests.support.engine_worker import launch

    with tempfile.TemporaryDirectory(prefix="bench-verify-", dir=args.dir) as tmp:
        spec = {"gb_per_rank": args.gb_per_rank, "reps": args.reps, "root": str(Path(tmp) / "checkpoints")}
        out = launch(2, spec, Path(tmp) / "work", timeout_s=1800, script=Path(__file__))
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    load = med["load"]
    import xxhash

    print(
        f"checkpoint {out['bytes'] / 1e9:.2f} GB on 2 ranks (saved in {out['save_s']:.1f} s); per core on this "
        f"CPU: xxh3_128 {hash_speed(xxhash.xxh3_128):.2f} GiB/s, sha256 {hash_speed(hashlib.sha256):.2f} GiB/s; "
        f"median of {args.reps}, files in the page cache"
    )
    print(f"  load alone                         {load:7.2f} s")
    both = med["verify_and_load"]
    added = statistics.median(b - a for a, b in zip(out["times"]["load"], out["times"]["verify_and_load"]))
    print(
        f"  verify (full) + load, overlapped   {both:7.2f} s   added to the load: {both / load - 1:+.2f}x by "
        f"the medians, {added / load:+.2f}x by the median per-repetition difference ({added:+.2f} s)"
    )
    ph = {k: statistics.median(v) for k, v in out["phases"].items()}
    print(
        f"    rank 0: hashing its share {ph['hash']:.2f} s in the background; the load reached its first "
        f"read {ph['before_reads']:.2f} s after the start and waited {ph['waited']:.2f} s there for the verdict"
    )
    for key, label in (
        ("verify_rank0_alone", "verify, rank 0 alone (earlier)"),
        ("verify_per_rank_full", "verify, per rank, full (before)"),
        ("verify_per_rank_sampled", "verify, per rank, sampled"),
    ):
        print(f"  {label:<35}{med[key]:7.2f} s   verify / load {med[key] / load:.2f}")
    print(
        f"  per-rank speed-up over rank 0 alone: {med['verify_rank0_alone'] / med['verify_per_rank_full']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json") and Path(sys.argv[1]).is_file():
        worker_spec = json.loads(Path(sys.argv[1]).read_text())
        result = worker(worker_spec)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(worker_spec["out"]).write_text(json.dumps(result))
        sys.exit(0)
    sys.exit(main())
