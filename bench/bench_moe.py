"""A tiny Mixture of Experts: step time at EP1 vs EP2 on 2 ranks, the share of the step in token dispatch, and
MoE vs a dense model of the same active parameters, printed as ratios.

    python -m bench.bench_moe [--steps 10] [--warmup 2] [--rounds 2] [--dispatcher alltoall]

Each run is a fresh 2-rank gloo world (one thread per rank) training with the engine's own model, optimizer
and ``Trainer.train_step`` on a synthetic source (tests/support/engine_worker.py builds them):

- ``moe-ep1``: the MoE (``--experts`` experts, top-``--topk``, expert width ``--expert-ffn``) at dp2, ep1: every
  rank holds every expert, gradients all-reduced;
- ``moe-ep2``: the same at dp2, ep2: each rank holds half of the experts, tokens travel by the token
  dispatcher (``--dispatcher``: alltoall or allgather) to their experts' rank and back;
- ``dense``: a dense GPT whose MLP is as wide as the experts a token goes through (top-k x expert width),
  so its parameters per token equal the MoE's active parameters.

Token dispatch: wall time inside megatron's token dispatcher (permutation, the all-to-alls / all-gathers and
their inverses in the forward: ``dispatch_preprocess``, ``token_dispatch``, ``dispatch_postprocess``,
``combine_preprocess``, ``token_combine``, ``combine_postprocess``) plus the backward of its all-to-alls,
as a share of the step (rank 0, the same steps). The figures are the median step of ``--steps`` after
``--warmup``, best of ``--rounds`` alternated runs (other load on the cores inflates single runs).
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

VOCAB = 2048
DISPATCH_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


def _timing(fn: Callable[..., Any], clock: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - t0

    return timed


def _time_dispatch(clock: list[float]) -> None:
    """Add the wall time of megatron's token dispatch (forward methods, the all-to-all's backward) to
    ``clock[0]`` (this benchmark's process only)."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    for cls in (token_dispatcher.MoEAlltoAllTokenDispatcher, token_dispatcher.MoEAllGatherTokenDispatcher):
        for name in DISPATCH_METHODS:
            setattr(cls, name, _timing(getattr(cls, name), clock))
    mappings._AllToAll.backward = staticmethod(_timing(mappings._AllToAll.backward, clock))


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: build, warm up, time ``steps`` steps; step times and dispatch seconds per step."""
    from engine.runtime import distributed as D
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.engine_worker import build_trainer

    model, par = ModelConfig(**spec["model"]), ParallelConfig(**spec["parallel"])
    stage = TrainStage(parallel=par, iters=1000, lr=1e-4, warmup_iters=0, threads=1, log_interval=1000)
    D.init(par.tp, par.pp, par.vpp, ep=par.ep, etp=par.etp, seed=stage.seed, threads=1)
    clock = [0.0]
    try:
        _time_dispatch(clock)
        chunks, trainer = build_trainer({"vocab": VOCAB, "samples": 256}, model, par, stage)
        total = sum(p.numel() for c in chunks for p in c.parameters())
        experts = sum(p.numel() for c in chunks for n, p in c.named_parameters() if ".mlp.experts." in n)
        active = total - experts + experts * model.moe_router_topk // max(model.num_experts or 0, 1)
        for i in range(spec["warmup"]):
            trainer.train_step(i)
        steps, dispatch = [], []
        for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
            clock[0] = 0.0
            t0 = time.perf_counter()
            trainer.train_step(i)
            steps.append(time.perf_counter() - t0)
            dispatch.append(clock[0])
        params = {"params_rank0": total, "active_params": active if model.num_experts else total}
        return {"step_times": steps, "dispatch_times": dispatch, **params}
    finally:
        D.shutdown()


def models(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    base = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": 4,
        "seq_length": args.seq,
        "add_bias_linear": False,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "position_embedding": "rope",
    }
    moe = {
        **base,
        "num_experts": args.experts,
        "moe_router_topk": args.topk,
        "moe_ffn_hidden_size": args.expert_ffn,
    }
    return {"moe": moe, "dense": {**base, "ffn_hidden_size": args.topk * args.expert_ffn}}


def measure(label: str, model: dict[str, Any], parallel: dict[str, Any], args: argparse.Namespace) -> dict:
    """Best-of-rounds median step time and dispatch time of one 2-rank configuration (a fresh world each)."""
    from tests.support.engine_worker import launch

    par = {"dp": 2, "micro_batch_size": args.micro_batch, "global_batch_size": args.global_batch, **parallel}
    spec = {"model": model, "parallel": par, "steps": args.steps, "warmup": args.warmup}
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix=f"bench-moe-{label}-") as tmp:
            result = launch(2, spec, Path(tmp), timeout_s=600, script=Path(__file__))
        step = statistics.median(result["step_times"])
        if not best or step < best["step_s"]:
            best = {"step_s": step, "dispatch_s": statistics.median(result["dispatch_times"])}
            best |= {"params_rank0": result["params_rank0"], "active_params": result["active_params"]}
    return best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="alternating repeats; the best of each")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=256, help="width of one expert's MLP")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse_args(argv)
    load = os.getloadavg()[0]
    ms = models(args)
    print(
        f"MoE {args.layers} layers, hidden {args.hidden}, seq {args.seq}, {args.experts} experts top-{args.topk} "
        f"(expert width {args.expert_ffn}); dense twin: ffn {args.topk * args.expert_ffn}. 2 ranks x 1 thread, "
        f"global batch {args.global_batch}, micro {args.micro_batch}, fp32, median of {args.steps} steps; "
        f"load average {load:.1f} at start",
        flush=True,
    )
    runs = {
        "moe-ep1": (ms["moe"], {"ep": 1, "moe_token_dispatcher": args.dispatcher}),
        "moe-ep2": (ms["moe"], {"ep": 2, "moe_token_dispatcher": args.dispatcher}),
        "dense": (ms["dense"], {}),
    }
    figures = {label: measure(label, model, par, args) for label, (model, par) in runs.items()}
    one, dense = figures["moe-ep1"], figures["dense"]
    print(
        f"parameters: MoE {one['params_rank0']:,} ({one['active_params']:,} active per token; EP2 rank 0 holds "
        f"{figures['moe-ep2']['params_rank0']:,}), dense {dense['params_rank0']:,}",
        flush=True,
    )
    for label, f in figures.items():
        share = f["dispatch_s"] / f["step_s"]
        print(
            f"{label:<8} step {f['step_s'] * 1e3:7.1f} ms   token dispatch {f['dispatch_s'] * 1e3:6.1f} ms "
            f"({share:.1%} of the step)",
            flush=True,
        )
    ep = figures["moe-ep2"]["step_s"] / figures["moe-ep1"]["step_s"]
    vs_dense = figures["moe-ep1"]["step_s"] / figures["dense"]["step_s"]
    print(
        f"EP2 / EP1 step time: {ep:.2f}x;  MoE (EP1) / dense of the same active parameters: {vs_dense:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "ep2_over_ep1": ep, "moe_over_dense": vs_dense}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json") and Path(sys.argv[1]).is_file():
        from tests.support.engine_worker import serve

        serve(worker)
    else:
        sys.exit(main())
