"""The training stall of a checkpoint save on 2 ranks, engine against torch DCP's async save of the same state.

    python -m bench.bench_ckpt_stall [--layers 14] [--hidden 768] [--repeats 3] [--threads 1]

Two data-parallel ranks (gloo, CPU), a GPT of ``--layers`` x ``--hidden`` (default ~105M parameters), fp32,
the non-distributed Adam (every rank holds the whole state; both savers write each replicated tensor once), after
one training step. Per save, on each rank, the seconds the training loop is blocked:

- ``engine sync``: ``Checkpointer.save`` without async (the whole write);
- ``engine async``: ``Checkpointer.save(async_save=True)`` (state dict, the writer's fork) plus the ``finalize``
  calls that commit it (checksums, marker, rename) while training steps run in between;
- ``dcp async``: ``torch.distributed.checkpoint.async_save`` of ``{"model": state_dict, "optim": the Adam
  state_dict}`` (the same tensors: planning and staging them in memory), its ``Future`` awaited only after
  training steps ran while it wrote;
- ``dcp sync``: ``torch.distributed.checkpoint.save`` of that state.

And the median step time while each async writer runs against the median without one (the slowdown).
Every figure is the median over ``--repeats`` saves and the slower of the two ranks, after one unmeasured save
of each kind (helper processes start on the first). Ratios are engine / reference in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bench_checkpoint import timed_save

VOCAB = 4096


def _trainer(spec: dict[str, Any]) -> Any:
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.engine_worker import build_trainer

    model = ModelConfig(
        num_layers=spec["layers"],
        hidden_size=spec["hidden"],
        num_attention_heads=spec["hidden"] // 64,
        seq_length=128,
    )
    par = ParallelConfig(micro_batch_size=1, global_batch_size=2, distributed_optimizer=False)
    stage = TrainStage(parallel=par, iters=10**6, warmup_iters=0, threads=spec["threads"])
    D.init(par.tp, par.pp, par.vpp, seed=stage.seed, threads=stage.threads)
    worker = {"vocab": VOCAB, "samples": 64, "ckpt": spec["ckpt"], "save_interval": 10**9}
    _, trainer = build_trainer(worker, model, par, stage)
    trainer.train_step(0)
    return trainer


def _any_rank(flag: bool) -> bool:
    """``flag`` on any rank (every rank calls it: the ranks' loops stay in step)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _steps_while(trainer: Any, pending: Callable[[], bool], tick: Callable[[], None]) -> list[float]:
    """Train while ``pending()`` on any rank; the seconds of each step (``tick`` after each: a finalize)."""
    times = []
    while _any_rank(pending()):
        times.append(_timed_step(trainer))
        tick()
    return times


def _engine_async(trainer: Any, step: int) -> tuple[float, list[float]]:
    from engine.checkpoint.writer import pending_async

    ckpt = trainer.checkpointer
    committed = len(ckpt.finalize_seconds)
    stall = timed_save(trainer, step, async_save=True)
    times = _steps_while(trainer, lambda: pending_async() > 0, ckpt.finalize)
    return stall + sum(ckpt.finalize_seconds[committed:]), times


def _dcp_state(trainer: Any) -> dict[str, Any]:
    return {
        "model": {f"{i}.{k}": v for i, c in enumerate(trainer.chunks) for k, v in c.state_dict().items()},
        "optim": trainer.optimizer.state_dict(),
    }


def _dcp_async(trainer: Any, path: Path, group: Any) -> tuple[float, list[float]]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    future: Any = dcp.async_save(_dcp_state(trainer), checkpoint_id=str(path), process_group=group)
    stall = time.perf_counter() - t0
    times = _steps_while(trainer, lambda: not future.done(), lambda: None)
    t1 = time.perf_counter()
    future.result()
    return stall + time.perf_counter() - t1, times


def _dcp_sync(trainer: Any, path: Path, group: Any) -> float:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(_dcp_state(trainer), checkpoint_id=str(path), process_group=group)
    return time.perf_counter() - t0


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's figures; rank 0 returns every rank's (gathered)."""
    import torch.distributed as dist

    from engine.models.gpt import num_parameters
    from engine.runtime import distributed as D

    trainer = _trainer(spec)
    dcp_root = Path(spec["dcp"])
    group = dist.new_group(backend="gloo")  # DCP's writer thread: collectives apart from the training's
    try:
        timed_save(
            trainer, 1, async_save=False
        )  # warm-ups: the writers' helpers start on the first save of each kind
        _engine_async(trainer, 2)
        _dcp_async(trainer, dcp_root / "warm", group)
        plain = [_timed_step(trainer) for _ in range(spec["repeats"] + 1)][1:]
        n = spec["repeats"]
        out: dict[str, Any] = {"plain_step_s": statistics.median(plain)}
        eng = [_engine_async(trainer, 10 + i) for i in range(n)]
        dca = [_dcp_async(trainer, dcp_root / f"a{i}", group) for i in range(n)]
        out["engine_async_s"] = statistics.median(s for s, _ in eng)
        out["dcp_async_s"] = statistics.median(s for s, _ in dca)
        for name, saves in (("engine", eng), ("dcp", dca)):  # None: no step overlapped any write
            busy = [t for _, ts in saves for t in ts]
            out[f"{name}_busy_step_s"] = statistics.median(busy) if busy else None
        out["engine_overlap_steps"] = statistics.median(len(ts) for _, ts in eng)
        out["dcp_overlap_steps"] = statistics.median(len(ts) for _, ts in dca)
        out["engine_sync_s"] = statistics.median(
            timed_save(trainer, 20 + i, async_save=False) for i in range(n)
        )
        out["dcp_sync_s"] = statistics.median(_dcp_sync(trainer, dcp_root / f"s{i}", group) for i in range(n))
        out["params"] = num_parameters(trainer.chunks)
        ranks = D.all_gather_object(out)
        if D.is_rank0():
            latest = max(Path(spec["ckpt"]).glob("iter_*"))
            return {"ranks": ranks, "engine_mb": _size_mb(latest), "dcp_mb": _size_mb(dcp_root / "s0")}
        return {}
    finally:
        D.shutdown()


def _timed_step(trainer: Any) -> float:
    t0 = time.perf_counter()
    trainer.train_step(0)
    return time.perf_counter() - t0


def _worst(result: dict[str, Any], key: str) -> float:
    values = [r[key] for r in result["ranks"] if r[key] is not None]
    return max(values) if values else float("nan")


def report(r: dict[str, Any]) -> None:
    w = {k: _worst(r, k) for k in r["ranks"][0]}
    print(
        f"{w['params'] / 1e6:.1f}M parameters, 2 ranks; checkpoint engine {r['engine_mb']:.0f} MB, "
        f"dcp {r['dcp_mb']:.0f} MB"
    )
    print("stall per save, seconds (the slower rank, median):")
    for name in ("engine_async", "dcp_async", "engine_sync", "dcp_sync"):
        print(f"  {name.replace('_', ' '):<13} {w[name + '_s']:8.3f}")
    print(f"engine async / dcp async:   {w['engine_async_s'] / w['dcp_async_s']:.2f}  (goal <= 1.0)")
    print(f"engine async / engine sync: {w['engine_async_s'] / w['engine_sync_s']:.2f}  (goal <= 0.1)")
    print(f"engine async / dcp sync:    {w['engine_async_s'] / w['dcp_sync_s']:.2f}")
    plain = w["plain_step_s"]
    for name in ("engine", "dcp"):
        busy, steps = w[f"{name}_busy_step_s"], w[f"{name}_overlap_steps"]
        print(
            f"step time while the {name} writer runs / without: {busy / plain:.3f} "
            f"({busy:.3f} s vs {plain:.3f} s; {steps:.0f} steps overlapped){'  (goal < 1.05)' * (name == 'engine')}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from tests.support.engine_worker import launch

    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "layers": a.layers,
            "hidden": a.hidden,
            "repeats": a.repeats,
            "threads": a.threads,
            "ckpt": str(Path(tmp) / "ckpt"),
            "dcp": str(Path(tmp) / "dcp"),
        }
        r = launch(2, spec, Path(tmp) / "run", timeout_s=3000, script=Path(__file__))
    print(json.dumps(r["ranks"], indent=1))
    report(r)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):  # a rank started by engine_worker.launch
        from tests.support.engine_worker import serve

        serve(measure)
    else:
        main()
