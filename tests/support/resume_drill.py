"""The exact-resume drill: run A trains 4 steps saving at 2 and 4, run B resumes from a copy of A's step-2
checkpoint; each save and load dumps this rank's model and optimizer state for bit-for-bit comparison.

Run as ``python -m tests.support.resume_drill SPEC.json`` (``launch`` does it) with a real tiny megatron GPT,
the engine's optimizer, Trainer and Checkpointer. SPEC keys: model, parallel (ModelConfig / ParallelConfig
fields), root (checkpoint root), dump (snapshot dir), init_from, async_save, peft, base_only (write the initial
weights as a checkpoint and stop), unpatched (engine.checkpoint.optim_fix patches to leave out), iters (default
4), global_dump (also dump ``global_snapshot``: state by global name), metrics (a metrics.jsonl path).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from tests.support import engine_worker

RUN_TIMEOUT_S = 480

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32}
MODEL_DROPOUT = {**MODEL, "hidden_dropout": 0.1, "attention_dropout": 0.1}


def launch(world: int, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run ``world`` ranks of the drill worker on a free port; rank 0's result (raises with the logs on failure)."""
    return engine_worker.launch(world, spec, tmp, timeout_s=RUN_TIMEOUT_S, script=Path(__file__))


def run_pair(tmp: Path, world: int, spec: dict[str, Any]) -> tuple[dict, dict, Path, Path]:
    """Run A (4 steps, saves at 2 and 4), then B resumed from A's step-2 checkpoint. Returns results, dump dirs."""
    a_root, b_root = tmp / "a" / "checkpoints", tmp / "b" / "checkpoints"
    a = launch(world, {**spec, "root": str(a_root), "dump": str(tmp / "a" / "dump")}, tmp / "a")
    shutil.copytree(a_root, b_root, ignore=shutil.ignore_patterns("iter_0000004"))
    b = launch(world, {**spec, "root": str(b_root), "dump": str(tmp / "b" / "dump")}, tmp / "b")
    return a, b, tmp / "a" / "dump", tmp / "b" / "dump"


def differing_tensors(left: Path, right: Path) -> list[str]:
    """Names of the entries of two snapshot files that differ in any bit (or exist in one only)."""
    import torch

    x, y = torch.load(left), torch.load(right)
    return sorted(set(x) ^ set(y)) + [
        k for k in sorted(set(x) & set(y)) if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])
    ]


def assert_same_tensors(left: Path, right: Path) -> None:
    differ = differing_tensors(left, right)
    assert not differ, f"{left} vs {right}: {len(differ)} tensors differ, e.g. {differ[:5]}"


def assert_exact_resume(a: dict, b: dict, a_dump: Path, b_dump: Path, world: int) -> None:
    assert b["resumed_from"] == 2 and a["resumed_from"] == 0
    assert b["history"] == a["history"][2:], "steps 3-4 after resume differ from the uninterrupted run"
    for rank in range(world):
        assert_same_tensors(a_dump / f"save2.rank{rank}.pt", b_dump / f"loaded.rank{rank}.pt")
        assert_same_tensors(a_dump / f"save4.rank{rank}.pt", b_dump / f"save4.rank{rank}.pt")


def snapshot(chunks: list, optimizer: Any) -> dict[str, Any]:
    """This rank's model parameters and optimizer state (main params, Adam moments, step, lr), cloned."""
    import torch

    from engine.models.gpt import unwrap

    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in unwrap(chunk).named_parameters():
            out[f"model{i}.{name}"] = p.detach().clone()
    for j, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            out[f"opt{j}.g{g}.lr"] = torch.tensor(group["lr"], dtype=torch.float64)
            for k, p in enumerate(group["params"]):
                out[f"opt{j}.g{g}.p{k}.main"] = p.detach().clone()
                for key, value in inner.state.get(p, {}).items():
                    out[f"opt{j}.g{g}.p{k}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def global_snapshot(chunks: list, optimizer: Any) -> dict[str, Any]:
    """This rank's parameters and Adam state keyed by global parameter name (engine.models.init_weights), so
    that snapshots of two layouts compare (a MoE model's experts by global expert index); fp32, no
    distributed optimizer (its state is sharded by buckets, not by parameter)."""
    import torch

    from engine.models.gpt import unwrap
    from engine.models.init_weights import global_name

    out, names = {}, {}
    for chunk in chunks:
        gpt = unwrap(chunk)
        for name, p in gpt.named_parameters():
            names[id(p)] = global_name(gpt, name)
            out[f"model.{names[id(p)]}"] = p.detach().clone()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                for key, value in inner.state.get(p, {}).items():
                    out[f"opt.{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine.checkpoint import optim_fix
    from engine.checkpoint.manager import Checkpointer
    from engine.checkpoint.save import save as save_checkpoint
    from engine.checkpoint.writer import finalize_async
    from engine.context import MetricsWriter
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from engine.train.optimizer import build_optimizer
    from engine.train.steps import make_step
    from engine.train.trainer import LoopServices, Trainer
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from pipeline.schema.stage_sections import PeftConfig
    from tests.support.synthetic import SyntheticSource

    for name in spec.get("unpatched", []):  # leave these faults of megatron as shipped
        del optim_fix._PATCHES[name]
    model_cfg, par = ModelConfig(**spec["model"]), ParallelConfig(**spec["parallel"])
    iters = spec.get("iters", 4)
    stage = TrainStage(parallel=par, iters=iters, save_interval=2, warmup_iters=1, threads=1, log_interval=1)
    D.init(par.tp, par.pp, par.vpp, ep=par.ep, etp=par.etp, seed=stage.seed, threads=stage.threads)
    dump, timings = Path(spec["dump"]), {"save_s": [], "load_s": None}
    dump.mkdir(parents=True, exist_ok=True)

    class DumpingCheckpointer(Checkpointer):
        """Records each save's duration and this rank's state at the moment of the save."""

        def maybe_save(self, *args, **kwargs):
            finalize_async()  # once per step, on every rank
            super().maybe_save(*args, **kwargs)

        def save(self, step, chunks, optimizer, scheduler, state, final=False, async_save=False):
            t0 = time.monotonic()
            async_save = bool(spec.get("async_save")) or async_save
            super().save(step, chunks, optimizer, scheduler, state, final=final, async_save=async_save)
            timings["save_s"].append(round(time.monotonic() - t0, 3))
            torch.save(snapshot(chunks, optimizer), dump / f"save{step}.rank{D.rank()}.pt")
            if spec.get("global_dump"):
                torch.save(global_snapshot(chunks, optimizer), dump / f"gsave{step}.rank{D.rank()}.pt")
            return self.last_saved

    peft = PeftConfig(**spec["peft"]) if spec.get("peft") else None
    try:
        chunks = build_model(model_cfg, par, 256, peft=peft)
        if spec.get("base_only"):  # write the initial weights as a checkpoint (a LoRA run's init_from)
            save_checkpoint(
                Path(spec["root"]), 0, model_chunks=chunks, optimizer=None, scheduler=None, state={}
            )
            return {}
        optimizer, scheduler = build_optimizer(chunks, stage, par)
        source = SyntheticSource(64, 256, model_cfg.seq_length, seed=1)
        trainer = Trainer(
            chunks,
            optimizer,
            scheduler,
            make_step("pretrain"),
            stage=stage,
            seq_length=model_cfg.seq_length,
            train_source=source,
            services=LoopServices(
                checkpointer=DumpingCheckpointer(
                    Path(spec["root"]), stage.save_interval, spec.get("init_from"), peft=peft
                ),
                metrics=MetricsWriter(Path(spec["metrics"]), enabled=D.is_rank0())
                if spec.get("metrics")
                else None,
            ),
        )
        t0 = time.monotonic()
        trainer.restore()
        if trainer.iteration or spec.get("init_from"):
            timings["load_s"] = round(time.monotonic() - t0, 3)
            torch.save(snapshot(chunks, optimizer), dump / f"loaded.rank{D.rank()}.pt")
            if spec.get("global_dump"):
                torch.save(global_snapshot(chunks, optimizer), dump / f"gloaded.rank{D.rank()}.pt")
        resumed_from = trainer.iteration
        trainer.fit()
        frozen = [p for c in chunks for p in c.parameters() if not p.requires_grad]
        return {
            "frozen": len(frozen),
            "frozen_with_grads": sum(
                1 for p in frozen if p.grad is not None or getattr(p, "main_grad", None) is not None
            ),
            "optimized": sum(len(g["params"]) for g in optimizer.param_groups),
            "history": trainer.history,
            "resumed_from": resumed_from,
            "optim_fix": optim_fix.applied(),
            **timings,
        }
    finally:
        D.shutdown()


if __name__ == "__main__":
    engine_worker.serve(worker)
