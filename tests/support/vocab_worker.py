"""Subprocess worker for the vocabulary-padding tests: one rank scoring and training tiny GPTs of several
vocabulary sizes under one layout; rank 0 writes every number as JSON.

Run through ``engine_worker.launch(world, spec, tmp, script=THIS)``. SPEC keys: parallel (ParallelConfig
overrides), model (ModelConfig overrides), cases (a list of ``{"vocab", "divisible_by"}``), out. Per case
(the model drawn by global name, so every layout starts from the same real rows):

- ``train``: losses of 3 pretraining steps and the trainer's validation loss after them;
- ``dpo``: the frozen model's DPO log-probs of 8 pairs [8, 2] and the losses of 2 DPO steps;
- ``logps``: per-token log-probs at temperature 0.7 (GRPO's and PPO's scoring step) of 4 rows [4, s];
- ``eval`` (pp=1: the eval stage's layouts): ``stages.eval.evaluate``'s valid loss, perplexity and
  preference margin on synthetic held-out sets;
- ``sampled``: the largest token id sampled (temperature 1, no vocabulary bound given to the generator).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

SEQ = 32


def _specs(spec: dict[str, Any], case: dict[str, Any], **over: Any) -> dict[str, Any]:
    model = {**spec.get("model", {}), "seq_length": SEQ, "make_vocab_size_divisible_by": case["divisible_by"]}
    return {
        "model": model,
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8, **spec.get("parallel", {})},
        "stage": {"lr": 3e-3, "min_lr": 3e-4, **over.pop("stage", {})},
        "vocab": case["vocab"],
        "samples": 32,
        **over,
    }


def _train(spec: dict[str, Any], case: dict[str, Any], step: str, iters: int) -> tuple[list[Any], Any]:
    from tests.support.engine_worker import build_trainer, configs

    s = _specs(spec, case, step=step, stage={"iters": iters})
    model_cfg, par, stage = configs(s)
    chunks, trainer = build_trainer(s, model_cfg, par, stage)
    trainer.fit()
    return chunks, trainer


def _logps(chunks: list[Any], vocab: int) -> list[Any]:
    """GRPO's scoring step (``LogpStep`` at temperature 0.7) on 4 rows, through megatron's schedule."""
    import torch

    from engine.rl.policy import LogpStep
    from engine.runtime import distributed as D
    from engine.train.units import run_micro_batches
    from tests.support.synthetic import SyntheticSource

    src = SyntheticSource(4, vocab, SEQ, seed=3)
    batch = {k: torch.from_numpy(np.stack([src[i][k] for i in range(4)])) for k in src[0]}
    out = run_micro_batches(
        chunks, LogpStep(temperature=0.7), [batch], seq_length=SEQ, micro_batch_size=4, forward_only=True
    )
    mine = out[0]["logps"].cpu().numpy() if D.owns_loss() else np.zeros((4, SEQ))
    return D.all_reduce_sum(mine).tolist()  # type: ignore[no-any-return]


def _eval(chunks: list[Any], vocab: int) -> dict[str, Any]:
    from stages.eval import evaluate
    from tests.support.synthetic import SyntheticPreferenceSource, SyntheticSource

    valid, pref = SyntheticSource(8, vocab, SEQ, seed=4), SyntheticPreferenceSource(4, vocab, SEQ, seed=5)
    sets = {"valid": [valid[i] for i in range(8)], "pref": [pref[i] for i in range(4)], "task": []}
    cfg = SimpleNamespace(eval=SimpleNamespace(batch_size=4), model=SimpleNamespace(seq_length=SEQ))
    r = evaluate(chunks, None, sets, cfg)
    return {k: r[k] for k in ("valid_loss", "perplexity", "pref_margin")}


def _sampled(chunks: list[Any], vocab: int) -> int:
    from engine.models.generate import SamplingParams, generate

    prompts = [[i % vocab, (3 * i + 1) % vocab] for i in range(8)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    gen = generate(chunks, prompts, params, vocab_size=None, use_cache=False)
    return max(max(t, default=0) for t in gen.tokens)


def _case(spec: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    from engine.models.gpt import build_model
    from engine.rl.dpo import reference_logps
    from engine.runtime import distributed as D
    from tests.support.engine_worker import configs
    from tests.support.synthetic import SyntheticPreferenceSource

    vocab = case["vocab"]
    _, trainer = _train(spec, case, "pretrain", 3)
    out: dict[str, Any] = {"train": [h["loss"] for h in trainer.history], "valid": trainer.evaluate()}
    model_cfg, par, stage = configs(_specs(spec, case, stage={"iters": 1}))
    prefs = SyntheticPreferenceSource(8, vocab, SEQ, seed=6)
    fresh = build_model(model_cfg, par, vocab, trainable=False)
    ref = reference_logps(fresh, prefs, first_step=0, steps=1, stage=stage, seq_length=SEQ)
    out["dpo"] = {"ref_logps": ref.tolist()}
    out["logps"] = _logps(fresh, vocab)
    if D.pp_size() == 1:
        out["eval"] = _eval(fresh, vocab)
    out["sampled"] = _sampled(fresh, vocab)
    _, dpo = _train(spec, case, "dpo", 2)
    out["dpo"]["train"] = [h["loss"] for h in dpo.history]
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from engine.runtime import distributed as D
    from tests.support.engine_worker import configs

    _, par, stage = configs(_specs(spec, spec["cases"][0]))
    D.init(par.tp, par.pp, par.vpp, seed=stage.seed, threads=1)
    try:
        return {f"{c['vocab']}/{c['divisible_by']}": _case(spec, c) for c in spec["cases"]}
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
