"""The engine's optimizer step on CPU: torch's fused AdamW kernel, one gradient norm per step, clipping.

A worker (fresh process: the CPU compatibility layer patches torch) builds a tiny model with
``build_optimizer`` and runs one ``Trainer.train_step`` with a clip small enough to clip:

- every torch AdamW inside megatron's optimizer runs fused, also after a ``load_state_dict`` of groups
  saved without the flag (a checkpoint from before, or from a GPU run);
- the update equals torch's unfused (single-tensor) AdamW applied to the same clipped gradients, group by
  group (megatron's groups: with and without weight decay), within fp32 rounding;
- the reported grad norm is the norm of the gradients before clipping: the clipped main grads have norm
  ``clip_grad`` (clipped once, with that norm), and the gradient norm was computed once, not twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.timing import scaled

CLIP = 0.05


@pytest.mark.dist
def test_fused_adam_step_equals_torch_adamw_on_clipped_grads(tmp_path: Path) -> None:
    from tests.support.engine_worker import launch

    out = launch(1, {}, tmp_path, timeout_s=scaled(600), script=Path(__file__))
    assert out["switched"] == 1 and out["fused"] and out["fused_after_load"], out
    assert out["groups"] == 2, out  # with and without weight decay
    assert out["grad_norm"] > CLIP, out  # the step clipped
    assert out["clipped_norm"] == pytest.approx(CLIP, rel=1e-4), out
    assert out["norm_calls"] == 1, out
    assert out["max_update"] > 0, out
    assert out["max_diff"] <= 1e-6 * out["max_update"] + 1e-9, out


# ---------------------------------------------------------------------------- worker


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine.models.gpt import build_model
    from engine.runtime import distributed as D
    from engine.train.optimizer import build_optimizer, fuse_cpu_adam
    from engine.train.steps import make_step
    from engine.train.trainer import Trainer
    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from tests.support.synthetic import SyntheticSource

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    par = ParallelConfig(micro_batch_size=2, global_batch_size=4)
    stage = TrainStage(parallel=par, iters=10, lr=1e-2, warmup_iters=0, clip_grad=CLIP, threads=1)
    D.init(1, 1, None, seed=1234, threads=1)
    try:
        chunks = build_model(model, par, 128)
        optimizer, scheduler = build_optimizer(chunks, stage, par)
        inner = optimizer.chained_optimizers[0].optimizer
        out: dict[str, Any] = {"switched": fuse_cpu_adam(optimizer), "groups": len(inner.param_groups)}
        out["fused"] = all(g["fused"] for g in inner.param_groups)
        saved = inner.state_dict()
        for g in saved["param_groups"]:
            g["fused"] = None
        inner.load_state_dict(saved)
        out["fused_after_load"] = all(g["fused"] for g in inner.param_groups)

        before = [[p.detach().clone() for p in g["params"]] for g in inner.param_groups]
        hyper = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in inner.param_groups]
        calls = 0
        chained_norm = type(optimizer.chained_optimizers[0]).get_grad_norm

        def counted(self: Any) -> Any:
            nonlocal calls
            calls += 1
            return chained_norm(self)

        type(optimizer.chained_optimizers[0]).get_grad_norm = counted
        source = SyntheticSource(16, 128, model.seq_length, seed=1)
        trainer = Trainer(
            chunks, optimizer, scheduler, make_step("pretrain"), stage=stage, seq_length=model.seq_length,
            train_source=source,
        )  # fmt: skip
        result = trainer.train_step(0)
        out["norm_calls"] = calls
        out["grad_norm"] = result["grad_norm"]
        grads = [p.grad for g in inner.param_groups for p in g["params"]]  # main grads, as clipped
        out["clipped_norm"] = float(torch.linalg.vector_norm(torch.stack([x.norm() for x in grads])))

        diff, update = 0.0, 0.0
        for group, start, h in zip(inner.param_groups, before, hyper, strict=True):
            ref = [t.clone().requires_grad_(True) for t in start]
            for r, p in zip(ref, group["params"], strict=True):
                r.grad = p.grad.clone()
            torch.optim.AdamW(ref, foreach=False, fused=False, **h).step()
            for r, p, s in zip(ref, group["params"], start, strict=True):
                diff = max(diff, float((r.detach() - p.detach()).abs().max()))
                update = max(update, float((p.detach() - s).abs().max()))
        out["max_diff"], out["max_update"] = diff, update
        return out
    finally:
        D.shutdown()


if __name__ == "__main__":
    from tests.support.engine_worker import serve

    serve(run)
