"""Checkpoint costs of the training engine: sync save, async stall, load, and time to recover after a kill.

    python -m bench.bench_checkpoint [--repeats 3] [--models tiny,big] [--no-recover] [--slurm]

Save / stall / load (one rank, a fresh process per model, through ``engine.checkpoint.manager.Checkpointer``
and ``engine.checkpoint`` as the trainer uses them; model and Adam state after one training step):

- ``sync save``: wall time of a synchronous save (the training loop is blocked for all of it).
- ``async stall``: the time the loop is blocked by an async save: the ``save`` call (state dict, fork of the
  writer) plus the ``finalize`` call that commits it (checksums, marker, rename) once the writer is done,
  while training steps run in between. ``ratio`` = async stall / sync save.
- ``load``: ``checkpoint.load`` of model, optimizer, scheduler and RNG.
Each figure is the median of ``--repeats`` after one unmeasured warm-up (the first save starts helper
processes). Models: ``tiny`` (ModelConfig defaults: 4 layers, hidden 128) and ``big`` (8 layers, hidden 512),
vocabulary 4096, seq 128.

Time to recover (``--no-recover`` skips it): ``python -m pipeline experiment=tiny`` pretrain with
``PIPELINE_FAULT=kill@step:7`` (SIGKILL before step 7; checkpoints every 4 steps), then the same command again.
Kill time = the fault's marker file; ``restart`` = start of the second command; ``resumed`` = its ``resume``
metrics record (checkpoint loaded); ``first step`` = the first training step after it.

Node failure on the real local SLURM cluster (``--slurm``; needs root and slurm/install.sh): runs
tests/slurm/test_slurm_node_failure.py, which kills the emulated node under pretrain (``slurm/cluster.py
kill-node``) and prints kill -> requeued -> restarted -> resumed -> first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 4096
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "big": {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8},
}
RECOVER_ARGS = ["experiment=tiny", "run.stages=[data_prep,pretrain]", "pretrain.iters=10"]
RECOVER_ARGS += ["pretrain.save_interval=4", "pretrain.log_interval=1"]
KILL_AT = 7


# ---------------------------------------------------------------------------- worker (one rank)


def _engine(spec: dict[str, Any]) -> Any:
    """A one-rank Trainer with model, optimizer and a synthetic source, after one training step."""
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.engine_worker import build_trainer

    model = ModelConfig(**spec["model"])
    par = ParallelConfig(micro_batch_size=4, global_batch_size=8)
    stage = TrainStage(parallel=par, iters=10**6, warmup_iters=0, threads=spec["threads"])
    D.init(par.tp, par.pp, par.vpp, seed=stage.seed, threads=stage.threads)
    # the Checkpointer keeps its default keep_last (2)
    worker_spec = {"vocab": VOCAB, "samples": 64, "ckpt": spec["ckpt"], "save_interval": 10**9}
    _, trainer = build_trainer(worker_spec, model, par, stage)
    trainer.train_step(0)
    return trainer


def timed_save(trainer: Any, step: int, async_save: bool) -> float:
    """The seconds one ``Checkpointer.save`` blocks the loop (async: until its writer is forked)."""
    ckpt = trainer.checkpointer
    ckpt.save(
        step, trainer.chunks, trainer.optimizer, trainer.scheduler, trainer.state(), async_save=async_save
    )
    return float(ckpt.save_seconds[-1])


def _async_stall(trainer: Any, step: int) -> tuple[float, int]:
    """Blocked seconds of one async save (save call + committing finalize) and the steps trained meanwhile."""
    from engine.checkpoint.writer import pending_async

    ckpt = trainer.checkpointer
    stall, steps, committed = timed_save(trainer, step, async_save=True), 0, len(ckpt.finalize_seconds)
    while pending_async():
        trainer.train_step(steps)
        steps += 1
        ckpt.finalize()
    return stall + sum(ckpt.finalize_seconds[committed:]), steps


def _load(trainer: Any) -> float:
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load

    latest = find_latest(trainer.checkpointer.root)
    t0 = time.perf_counter()
    load(latest, model_chunks=trainer.chunks, optimizer=trainer.optimizer, scheduler=trainer.scheduler)
    return time.perf_counter() - t0


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    from engine.models.gpt import num_parameters
    from engine.runtime import distributed as D

    trainer = _engine(spec)
    try:
        n, step = spec["repeats"], 1
        timed_save(trainer, step, async_save=False)  # warm-up: helper processes start on the first save
        _async_stall(trainer, step + 1)
        sync = [timed_save(trainer, step + 2 + i, async_save=False) for i in range(n)]
        stalls = [_async_stall(trainer, step + 2 + n + i) for i in range(n)]
        loads = [_load(trainer) for _ in range(n)]
        latest = max(Path(spec["ckpt"]).glob("iter_*"))
        return {
            "params": num_parameters(trainer.chunks),
            "ckpt_mb": sum(p.stat().st_size for p in latest.rglob("*") if p.is_file()) / 2**20,
            "sync_save_s": statistics.median(sync),
            "async_stall_s": statistics.median(s for s, _ in stalls),
            "async_overlap_steps": statistics.median(k for _, k in stalls),
            "load_s": statistics.median(loads),
        }
    finally:
        D.shutdown()


# ---------------------------------------------------------------------------- time to recover after a kill


def _pipeline(root: Path, fault: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *RECOVER_ARGS, f"run.root={root}"],
        cwd=ROOT,
        env={**os.environ, "PIPELINE_FAULT": fault},
        capture_output=True,
        text=True,
        timeout=900,
    )


def recover_after_kill(work: Path) -> dict[str, float]:
    """Kill pretrain before step KILL_AT, run the same command again; seconds from the kill to each milestone."""
    r = _pipeline(work, f"kill@step:{KILL_AT}")
    if r.returncode == 0:
        raise RuntimeError("the killed run completed: " + r.stdout[-1000:])
    restart = time.time()
    r = _pipeline(work)
    if r.returncode != 0:
        raise RuntimeError("the rerun failed: " + r.stdout[-1000:] + r.stderr[-1000:])
    (run_dir,) = [p for p in work.iterdir() if p.is_dir() and not p.name.startswith(".")]
    out = run_dir / "stages" / "pretrain"
    killed = float((out / ".faults" / f"kill@step:{KILL_AT}.rank0").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resume = next(m for m in records if m["kind"] == "resume")
    first = next(m for m in records if m["kind"] == "train" and m["time"] > resume["time"])
    return {
        "kill_to_restart_s": restart - killed,
        "kill_to_resumed_s": resume["time"] - killed,
        "kill_to_first_step_s": first["time"] - killed,
        "resumed_from": resume["from_step"],
        "steps_lost": resume["steps_lost"],
    }


def slurm_node_failure() -> str:
    """Run the SLURM node-failure test and return its recovery line (or why it did not run)."""
    import slurm_cluster

    why = slurm_cluster.unavailable_reason()
    if why:
        return f"skipped: {why}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-s",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/slurm/test_slurm_node_failure.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("node failure under pretrain:")]
    return lines[0] if lines and r.returncode == 0 else f"failed (rc {r.returncode}):\n{r.stdout[-2000:]}"


# ---------------------------------------------------------------------------- report


def _row(name: str, m: dict[str, Any]) -> str:
    ratio = m["async_stall_s"] / m["sync_save_s"]
    return (
        f"{name:<5} {m['params'] / 1e6:>7.2f}M {m['ckpt_mb']:>8.1f} {m['sync_save_s']:>9.3f} "
        f"{m['async_stall_s']:>11.3f} {ratio:>6.2f} {m['async_overlap_steps']:>8.0f} {m['load_s']:>7.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,big")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-recover", action="store_true", help="skip the kill / re-run measurement")
    ap.add_argument("--slurm", action="store_true", help="also kill an emulated SLURM node (needs root)")
    args = ap.parse_args()
    from tests.support.engine_worker import launch

    print(
        f"{'model':<5} {'params':>8} {'ckpt MB':>8} {'sync save':>9} {'async stall':>11} {'ratio':>6} "
        f"{'overlap':>8} {'load':>7}   (seconds; overlap = steps trained while the async write ran)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in filter(None, args.models.split(",")):
            spec = {
                "model": MODELS[name],
                "threads": args.threads,
                "repeats": args.repeats,
                "ckpt": str(Path(tmp) / name / "ckpt"),
            }
            print(
                _row(name, launch(1, spec, Path(tmp) / name, timeout_s=1800, script=Path(__file__))),
                flush=True,
            )
        if not args.no_recover:
            rec = recover_after_kill(Path(tmp) / "recover")
            print(
                f"\nkill@step:{KILL_AT} (tiny, local executor): restart +{rec['kill_to_restart_s']:.1f} s, "
                f"checkpoint loaded +{rec['kill_to_resumed_s']:.1f} s, first resumed step "
                f"+{rec['kill_to_first_step_s']:.1f} s (from step {rec['resumed_from']}, "
                f"{rec['steps_lost']} steps lost)"
            )
    if args.slurm:
        print("\nSLURM node failure: " + slurm_node_failure())
    else:
        print(
            "\nSLURM node failure: skipped (run with --slurm, as root with slurm/install.sh done; or "
            "`pytest -s tests/slurm/test_slurm_node_failure.py`)"
        )


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):  # a rank started by engine_worker.launch
        spec = json.loads(Path(sys.argv[1]).read_text())
        Path(spec["out"]).write_text(json.dumps(measure(spec)))
    else:
        main()
