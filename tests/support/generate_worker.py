"""Subprocess worker for the generation tests: one rank of a tiny model generating, results as JSON.

Run through ``engine_worker.launch(world, spec, tmp, script=THIS)``. SPEC keys: model, parallel (overrides
of ModelConfig / ParallelConfig), vocab, prompts (token-id lists), new (max new tokens), save_weights /
load_weights (checkpoint root of the model weights, as in engine_worker), out (rank 0's result file).
"""

from __future__ import annotations

from typing import Any

from tests.support.engine_worker import _weights


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from engine.models.generate import SamplingParams, generate
    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.sections import ParallelConfig

    model_cfg = ModelConfig(**spec.get("model", {}))
    par = ParallelConfig(**spec.get("parallel", {}))
    D.init(par.tp, par.pp, par.vpp, seed=1234, threads=1)
    try:
        vocab = spec.get("vocab", 256)
        chunks = build_model(model_cfg, par, vocab)
        if spec.get("load_weights"):
            _weights(chunks, spec["load_weights"], save=False)
        if spec.get("save_weights"):
            _weights(chunks, spec["save_weights"], save=True)
        prompts, new = spec["prompts"], spec["new"]

        def run_one(use_cache: bool = True, **kw: Any) -> dict[str, Any]:
            g = generate(
                chunks,
                prompts,
                SamplingParams(max_new_tokens=new, **kw),
                vocab_size=vocab,
                use_cache=use_cache,
            )
            return {"tokens": g.tokens, "stopped": g.stopped, "ends": g.ends}

        greedy = run_one()
        stops = [greedy["tokens"][0][2], greedy["tokens"][1][0]]  # two stop tokens, as an end-of-turn and eos
        sample = {"temperature": 1.0, "top_p": 0.9, "top_k": 50}
        return {
            "greedy_cache": greedy,
            "greedy_full": run_one(use_cache=False),
            "stop_tokens": stops,
            "stopped": run_one(stop_tokens=tuple(stops)),
            "sample_a": run_one(seed=7, **sample),
            "sample_b": run_one(seed=7, **sample),
            "sample_c": run_one(seed=8, **sample),
            "sample_full": run_one(use_cache=False, seed=7, **sample),
            "top_k1": run_one(seed=3, temperature=1.0, top_k=1),
        }
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
