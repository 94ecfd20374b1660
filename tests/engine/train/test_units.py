"""A unit's second trained model (a critic) has its own part of the checkpoint: weights, optimizer, schedule.

One rank in a subprocess (this file run as a script is the worker): a policy and a critic, each with its own
optimizer, train a step; the checkpoint is saved with the critic as a named part; both train on; loading the
checkpoint brings both back bit for bit (parameters, Adam moments, steps, LR schedule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import engine_worker
from tests.support.timing import scaled

MODEL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16}


def launch(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The worker as one rank on a free port; its result (the log on failure)."""
    return engine_worker.launch(1, spec, tmp, timeout_s=scaled(480), script=Path(__file__))


@pytest.mark.timeout(600)
def test_a_trained_second_model_saves_and_loads_its_own_part(tmp_path: Path) -> None:
    r = launch({"root": str(tmp_path / "ckpt")}, tmp_path)
    assert r["critic_differs_from_policy"], r
    assert r["changed_after_save"] == {"policy": True, "critic": True}, r
    assert r["mismatch"] == {"policy": [], "critic": []}, r
    assert r["critic_lr_steps"] == r["saved_critic_lr_steps"], r


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine.checkpoint.load import load
    from engine.checkpoint.save import save
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from engine.train.optimizer import build_optimizer
    from engine.train.steps import make_step
    from engine.train.trainer import Trainer
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.resume_drill import snapshot
    from tests.support.synthetic import SyntheticSource

    model_cfg, par = ModelConfig(**MODEL), ParallelConfig(micro_batch_size=2, global_batch_size=4)
    stage = TrainStage(parallel=par, iters=4, warmup_iters=1, threads=1, log_interval=1)
    D.init(1, 1, None, seed=stage.seed, threads=1)
    try:
        models = {}
        for name, seed in (("policy", 1), ("critic", 2)):
            chunks = build_model(model_cfg, par, 64)
            if name == "critic":
                with torch.no_grad():
                    for p in chunks[0].parameters():
                        p.add_(0.5)
            opt, sch = build_optimizer(chunks, stage, par)
            source = SyntheticSource(16, 64, model_cfg.seq_length, seed=seed)
            trainer = Trainer(
                chunks, opt, sch, make_step("pretrain"), stage=stage, seq_length=16, train_source=source
            )
            models[name] = (chunks, opt, sch, trainer)
        for _, _, _, t in models.values():
            t.train_step(0)
        saved = {n: snapshot(c, o) for n, (c, o, _, _) in models.items()}
        saved_steps = models["critic"][2].num_steps
        pc, po, ps, _ = models["policy"]
        cc, co, cs, _ = models["critic"]
        root = Path(spec["root"])
        path = save(
            root, 1, model_chunks=pc, optimizer=po, scheduler=ps, state={}, models={"critic": (cc, co, cs)}
        )
        for _, _, _, t in models.values():
            t.train_step(1)
        after = {n: snapshot(c, o) for n, (c, o, _, _) in models.items()}
        load(path, model_chunks=pc, optimizer=po, scheduler=ps, models={"critic": (cc, co, cs)})
        loaded = {n: snapshot(c, o) for n, (c, o, _, _) in models.items()}
        return {
            "critic_differs_from_policy": not torch.equal(
                saved["policy"]["model0.decoder.final_layernorm.weight"],
                saved["critic"]["model0.decoder.final_layernorm.weight"],
            ),
            "changed_after_save": {
                n: any(not torch.equal(saved[n][k], after[n][k]) for k in saved[n]) for n in saved
            },
            "mismatch": {
                n: [k for k in saved[n] if not torch.equal(saved[n][k], loaded[n][k])] for n in saved
            },
            "critic_lr_steps": cs.num_steps,
            "saved_critic_lr_steps": saved_steps,
        }
    finally:
        D.shutdown()


if __name__ == "__main__":
    engine_worker.serve(worker)
