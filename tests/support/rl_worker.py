"""Subprocess worker for the data-parallel rollout test: one rank of a tiny policy running GRPO's and PPO's
rollout (engine.rl.grpo, engine.rl.ppo) with a deterministic per-row reward; every rank's view as JSON (rank 0 writes it).

Run through ``engine_worker.launch(world, spec, tmp, script=THIS)``. SPEC keys: rlhf (RLHFStage overrides,
``parallel`` as ParallelConfig overrides), prompts (token-id lists), step, out.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

VOCAB, PAD, EOD = 64, 0, 1


def reward_of(prompt: list[int], response: list[int]) -> float:
    """A deterministic reward of one row (the test recomputes it): varies with the sampled tokens."""
    return float(sum(response) % 5) + 0.25 * len(response) + 0.01 * len(prompt)


class CountingReward:
    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, prompts: Any, responses: Any) -> np.ndarray:
        self.rows += len(prompts)
        return np.array([reward_of(list(p), list(r)) for p, r in zip(prompts, responses)], dtype=np.float32)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from engine.models.gpt import build_model
    from engine.rl.grpo import GRPOUnit
    from engine.rl.ppo import PPOUnit
    from engine.rl.rollout import PromptStream
    from engine.runtime import distributed as D
    from engine.train.meter import StepMeter
    from engine.train.units import NamedModel, frozen
    from pipeline.schema.config import ModelConfig, RLHFStage
    from pipeline.schema.sections import ParallelConfig

    rl = dict(spec["rlhf"])
    par = ParallelConfig(**rl.pop("parallel"))
    st = RLHFStage(parallel=par, **rl)
    model_cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=24)
    D.init(par.tp, par.pp, None, seed=st.seed, threads=1)
    try:
        policy = build_model(model_cfg, par, VOCAB)
        reference = frozen(build_model(model_cfg, par, VOCAB, trainable=False))
        trainer = SimpleNamespace(chunks=policy, meter=StepMeter(), seq_length=model_cfg.seq_length, stage=st)
        tok = SimpleNamespace(eod=EOD, pad=PAD, vocab_size=VOCAB)
        out: dict[str, Any] = {"dp_rank": D.dp_rank(), "dp_size": D.dp_size()}
        for name, cls in (("grpo", GRPOUnit), ("ppo", PPOUnit)):
            reward = CountingReward()
            unit = cls(
                source=None,
                models={"reference": NamedModel("reference", reference)},
                prompts=PromptStream(spec["prompts"], st.seed),
                reward=reward,
                tokenizer=tok,
                settings=st,
            )
            unit.trainer = trainer  # a stand-in: the rollout reads chunks, meter, seq_length, stage
            arrays, metrics = unit._rollout(spec["step"])
            again, _ = unit._rollout(spec["step"])  # the same step redraws the same samples
            view = {
                "generated_rows": unit.generated_rows,
                "reward_rows": reward.rows,
                "rows": [_row(arrays, i) for i in range(len(arrays["tokens"]))],
                "redrawn_equal": all(np.array_equal(arrays[k], again[k]) for k in arrays),
                "metrics": metrics,
                "position": unit.position,
            }
            view["advantages" if name == "grpo" else "score"] = arrays[
                "advantages" if name == "grpo" else "score"
            ].tolist()
            if name == "grpo":
                batches = unit.updates(spec["step"])
                view["update_rows"] = [sum(len(b["tokens"]) for b in bs) for bs in batches]
                view["ref_logp_rows"] = sum(len(b["ref_logp"]) for b in batches[0])
            out[name] = view
        return {"ranks": D.all_gather_object(out)}
    finally:
        D.shutdown()


def _row(arrays: dict[str, np.ndarray], i: int) -> dict[str, list[int]]:
    """A rollout row back as prompt and response (+ eod when the sampler stopped on it) token ids."""
    mask = arrays["loss_mask"][i] > 0
    first = int(np.argmax(mask))
    ids = [int(arrays["tokens"][i][0]), *map(int, arrays["labels"][i][: first + int(mask.sum())])]
    return {"prompt": ids[: first + 1], "response": ids[first + 1 :]}


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
