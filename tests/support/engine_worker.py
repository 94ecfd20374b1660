"""Subprocess worker for the engine tests: one rank of a tiny training run, results as JSON.

Run as ``python -m tests.support.engine_worker SPEC.json`` with RANK/WORLD_SIZE/... set (``launch`` does it).
Each run is a fresh process, so torch patches and megatron globals never leak between tests. ``configs`` and
``build_trainer`` build the same model and Trainer inside another worker (after ``D.init``).

SPEC keys: model, parallel, stage (overrides of ModelConfig / ParallelConfig / TrainStage), step
(pretrain | sft | dpo), samples (source size; = global batch for a repeated batch), vocab, save_weights /
load_weights (a checkpoint root for the model weights only, every model chunk, written with
engine.checkpoint.save/load), ckpt (a checkpoint root: resume from it and save every ``save_interval``
steps through the trainer's Checkpointer), save_interval, metrics (a metrics.jsonl path), out (result
file of rank 0; set by launch), peft (a PeftConfig dict: LoRA), tensorboard (a TensorBoard log dir), raising_sink (add a sink that raises),
sinks (names of engine.callbacks.setup.SINKS for a stage ``pretrain`` in ``stage_dir`` of run ``run_dir``, with
MonitorConfig fields ``monitor``; the spec is the config they record).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.env import REPO, module_command, rank_env
from tests.support.timing import scaled

PORT_TAKEN = "EADDRINUSE"
"""In rank 0's log when its rendezvous port was taken between ``free_port`` and its bind (another test's
process got it): the ranks are started again on another port."""


def launch(
    world: int,
    spec: dict[str, Any],
    tmp: Path,
    timeout_s: float = scaled(480),
    script: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``world`` ranks of the worker and return rank 0's result (raises with the logs on failure).

    ``script``: another worker taking ``SPEC.json`` the same way (default: this file), run as a module of the
    checkout when it is one. ``extra_env``: variables added to each rank's environment. A rank that fails ends
    the others at once (a peer left waiting on a dead rank's rendezvous would hang to the deadline), and the
    deadline is under the tests' 600 s limit, so a failure comes with every rank's log.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(tmp / "result.json")}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    deadline = time.monotonic() + timeout_s
    for _ in range(3):
        codes = _run_ranks(world, spec_path, tmp, script, extra_env, deadline)
        if not any(codes) or PORT_TAKEN not in (tmp / "rank0.log").read_text(errors="replace"):
            break
    if any(codes):
        tails = "\n".join(
            f"--- rank {r} (rc={c})\n" + (tmp / f"rank{r}.log").read_text(errors="replace")[-3000:]
            for r, c in enumerate(codes)
        )
        raise RuntimeError(f"worker failed: {codes}\n{tails}")
    return json.loads((tmp / "result.json").read_text())


def _run_ranks(
    world: int,
    spec_path: Path,
    tmp: Path,
    script: Path | None,
    extra_env: dict[str, str] | None,
    deadline: float,
) -> list[int]:
    """Start the ranks on a fresh port and wait for all; the first to fail, or the deadline, ends the rest.
    Returns their exit codes (negative: killed)."""
    from engine.runtime.distributed import free_port

    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = rank_env(rank, world, port, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(extra_env or {}))
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115
        logs.append(log)
        cmd = [sys.executable, *module_command(Path(script or __file__)), str(spec_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode for p in procs if p.returncode is not None)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    return [p.wait() for p in procs]


def _weights(chunks: list[Any], path: str, save: bool) -> None:
    """Save (as iteration 0) or load the weights of every model chunk under checkpoint root ``path``."""
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load_weights
    from engine.checkpoint.save import save as save_checkpoint

    if save:
        save_checkpoint(Path(path), 0, model_chunks=chunks, optimizer=None, scheduler=None, state={})
        return
    latest = find_latest(Path(path))
    if latest is None:
        raise FileNotFoundError(f"load_weights={path}: no complete checkpoint there")
    load_weights(latest, chunks)


def _checkpointer(spec: dict[str, Any]) -> Any:
    from engine.checkpoint.manager import Checkpointer

    if not spec.get("ckpt"):
        return None
    return Checkpointer(Path(spec["ckpt"]), spec.get("save_interval", 1000))


def _callbacks(spec: dict[str, Any]) -> Any:
    """``tensorboard``: a TensorBoard sink writing there; ``raising_sink``: a sink that raises at every hook."""
    from engine.train.callback import Callback, Callbacks

    class Raising(Callback):
        def on_step_end(self, view: Any) -> None:
            raise RuntimeError("sink broken")

    cbs: list[Any] = [Raising()] if spec.get("raising_sink") else []
    if spec.get("tensorboard"):
        from engine.callbacks.tensorboard import TensorBoard

        cbs.append(TensorBoard(Path(spec["tensorboard"])))
    if spec.get("sinks"):
        from engine.callbacks.setup import SINKS
        from engine.train.callback import StageInfo
        from pipeline.schema.stage_sections import MonitorConfig

        mon = MonitorConfig(**{**spec.get("monitor", {}), "sinks": spec["sinks"]})
        info = StageInfo("pretrain", Path(spec["stage_dir"]), Path(spec["run_dir"]), config=spec)
        cbs += [SINKS[name](mon, info) for name in mon.sinks]
        return Callbacks(cbs, info)
    return Callbacks(cbs) if cbs else None


def configs(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """SPEC's ModelConfig, ParallelConfig and TrainStage (log every step, no warmup, one thread by default)."""
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig

    model_cfg = ModelConfig(**spec.get("model", {}))
    par = ParallelConfig(**spec.get("parallel", {}))
    stage = TrainStage(
        parallel=par, **{"log_interval": 1, "warmup_iters": 0, "threads": 1, **spec.get("stage", {})}
    )
    return model_cfg, par, stage


def build_trainer(spec: dict[str, Any], model_cfg: Any, par: Any, stage: Any) -> tuple[list[Any], Any]:
    """The model chunks and a Trainer on synthetic data as SPEC says (after ``D.init``; see the module
    docstring for the keys)."""
    from engine.context import MetricsWriter
    from engine.models.gpt import build_model
    from engine.models.moe import routing_stats
    from engine.rl.dpo import DPOStep, WithReference, reference_logps
    from engine.runtime import distributed as D
    from engine.train.optimizer import build_optimizer
    from engine.train.steps import make_step
    from engine.train.trainer import LoopServices, Trainer
    from pipeline.schema.stage_sections import PeftConfig
    from tests.support.synthetic import SyntheticPreferenceSource, SyntheticSource

    vocab = spec.get("vocab", 256)
    peft = PeftConfig(**spec["peft"]) if spec.get("peft") else None
    chunks = build_model(model_cfg, par, vocab, peft=peft)
    if spec.get("load_weights"):
        _weights(chunks, spec["load_weights"], save=False)
    if spec.get("save_weights"):
        _weights(chunks, spec["save_weights"], save=True)
    optimizer, scheduler = build_optimizer(chunks, stage, par)
    name = spec.get("step", "pretrain")
    n = spec.get("samples", 64)
    seq = model_cfg.seq_length
    if name == "dpo":
        prefs = SyntheticPreferenceSource(n, vocab, seq, seed=1)
        ref = reference_logps(chunks, prefs, first_step=0, steps=stage.iters, stage=stage, seq_length=seq)
        source: Any = WithReference(prefs, ref, 0)
        step = DPOStep(beta=stage.beta)
    else:
        source = SyntheticSource(n, vocab, seq, seed=1)
        step = make_step(name)
    valid = SyntheticSource(32, vocab, seq, seed=2) if name != "dpo" else None
    metrics = MetricsWriter(Path(spec["metrics"]), enabled=D.is_rank0()) if spec.get("metrics") else None
    trainer = Trainer(
        chunks,
        optimizer,
        scheduler,
        step,
        stage=stage,
        seq_length=seq,
        train_source=source,
        valid_source=valid,
        services=LoopServices(
            metrics=metrics,
            checkpointer=_checkpointer(spec),
            callbacks=_callbacks(spec),
            routing=routing_stats(chunks, model_cfg, par),
        ),
    )
    return chunks, trainer


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: init, build, restore, fit; the summary, history and sizes of the run."""
    from engine.models.gpt import model_config, num_parameters
    from engine.runtime import distributed as D

    model_cfg, par, stage = configs(spec)
    D.init(par.tp, par.pp, par.vpp, ep=par.ep, etp=par.etp, seed=stage.seed, threads=stage.threads)
    try:
        chunks, trainer = build_trainer(spec, model_cfg, par, stage)
        trainer.restore()
        resumed = trainer.state()
        t0 = time.time()
        summary = trainer.fit()
        wall = time.time() - t0
        if trainer.callbacks:
            trainer.callbacks.close()
        return {
            "summary": summary,
            "history": trainer.history,
            "resumed": resumed,
            "recompute": model_config(chunks).recompute_granularity,
            "wall_s": wall,
            "params_rank0": num_parameters(chunks),
            "trainable_rank0": sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad),
            "tokens_per_step": par.global_batch_size
            * model_cfg.seq_length
            * trainer.step.sequences_per_sample,
        }
    finally:
        D.shutdown()


def serve(work: Callable[[dict[str, Any]], Any]) -> None:
    """A worker script's main (``python <worker> SPEC.json``, as ``launch`` starts it): ``work(spec)`` on this
    rank; rank 0 writes the result as JSON to ``spec["out"]``."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = work(spec)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["out"]).write_text(json.dumps(result, default=float))
    # The work is done and its process groups destroyed: leave without the interpreter's teardown, where a
    # gloo thread torn down late can abort the process ("terminate called without an active exception", rc -6,
    # seen once in a loaded full run) after a correct result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve(run)
