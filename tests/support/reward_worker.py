"""Subprocess worker for the reward-model tests: one rank; trains the reward model on separable pairs, then
scores held-out pairs with the frozen ``RewardModel``. Results of rank 0 as JSON (``launch`` in engine_worker).

SPEC keys: parallel (ParallelConfig overrides), iters, ckpt (checkpoint root), init (a checkpoint root of a
plain GPT saved first and loaded with the head fresh, as init_from from SFT does), out (set by launch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

VOCAB, SEQ, PAD, GOOD, BAD = 64, 16, 0, 7, 9


class SeparablePairs:
    """Pairs whose chosen response ends with token GOOD and rejected with BAD (random prompt and lengths)."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.items = []
        for _ in range(n):
            prompt = list(rng.integers(10, VOCAB, int(rng.integers(3, 6))))
            body = list(rng.integers(10, VOCAB, int(rng.integers(1, 5))))
            rows = []
            for last in (GOOD, BAD):
                ids = [*prompt, *body, last, 1]  # 1: eod
                loss = [0] * len(prompt) + [1] * (len(body) + 2)
                tokens, labels = np.full(SEQ, PAD), np.full(SEQ, PAD)
                mask = np.zeros(SEQ, np.float32)
                n_ = len(ids) - 1
                tokens[:n_], labels[:n_], mask[:n_] = ids[:-1], ids[1:], loss[1:]
                rows.append(
                    {
                        "tokens": tokens,
                        "labels": labels,
                        "loss_mask": mask,
                        "prompt": prompt,
                        "resp": [*body, last, 1],
                    }
                )
            self.items.append(rows)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        rows = self.items[int(i) % len(self.items)]
        return {
            k: np.stack([r[k] for r in rows]).astype(np.int64 if k != "loss_mask" else np.float32)
            for k in ("tokens", "labels", "loss_mask")
        }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from engine.checkpoint.latest import find_latest
    from engine.checkpoint.load import load_weights
    from engine.checkpoint.manager import Checkpointer
    from engine.checkpoint.save import save
    from engine.models.gpt import build_model
    from engine.models.reward import HEAD, build
    from engine.rl.frozen_reward import RewardModel
    from engine.runtime import distributed as D
    from engine.train.optimizer import build_optimizer
    from engine.train.steps import make_step
    from engine.train.trainer import LoopServices, Trainer
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig

    model_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ)
    par = ParallelConfig(**{"micro_batch_size": 4, "global_batch_size": 8, **spec.get("parallel", {})})
    stage = TrainStage(
        parallel=par,
        iters=spec.get("iters", 40),
        lr=3e-3,
        min_lr=3e-4,
        warmup_iters=0,
        log_interval=1,
        threads=1,
    )
    D.init(par.tp, par.pp, par.vpp, seed=stage.seed, threads=1)
    try:
        out: dict[str, Any] = {}
        step = make_step("reward")
        chunks = build(model_cfg, par, VOCAB)
        if spec.get("init"):  # a plain GPT checkpoint (like SFT's) loads into the reward model, head fresh
            plain = build_model(model_cfg, par, VOCAB)
            save(Path(spec["init"]), 0, model_chunks=plain, optimizer=None, scheduler=None, state={})
            load_weights(find_latest(Path(spec["init"])), chunks, fresh=(HEAD,))
            out["init_loaded"] = True
        optimizer, scheduler = build_optimizer(chunks, stage, par)
        trainer = Trainer(
            chunks,
            optimizer,
            scheduler,
            step,
            stage=stage,
            seq_length=SEQ,
            train_source=SeparablePairs(64, seed=1),
            valid_source=SeparablePairs(16, seed=2),
            services=LoopServices(checkpointer=Checkpointer(Path(spec["ckpt"]), 1000)),
        )
        trainer.restore(init_weights=False)
        out["summary"] = trainer.fit()
        out["history"] = trainer.history
        held = SeparablePairs(24, seed=3)
        prompts = [r["prompt"] for rows in held.items for r in rows]
        resps = [r["resp"] for rows in held.items for r in rows]
        rm = RewardModel(
            Path(spec["ckpt"]), model_cfg, par, VOCAB, pad_id=PAD, eod_id=1, seq_length=SEQ, batch_size=5
        )
        scores = rm(prompts, resps)
        out["scores"] = scores.tolist()
        out["dtype"] = str(scores.dtype)
        pairs = scores.reshape(-1, 2)
        out["held_out_accuracy"] = float(np.mean(pairs[:, 0] > pairs[:, 1]))
        return out
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
