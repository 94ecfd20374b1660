"""LoRA on a Mixture-of-Experts model: attention, the dense layers' MLP and the shared expert are adapted, the
routed experts never are (engine/models/lora.py ROUTED_EXPERTS); EP2 gives EP1's losses; the planner counts
the adapters the engine trains; MLP targets that would adapt nothing are a config error."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from pipeline.cli.plan import compose_config
from pipeline.schema.config import ModelConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.params import lora_layer_params
from tests.support.engine_worker import launch

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
MOE = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 96,
    "seq_length": 32, "vocab_size": 512, "activation": "swiglu", "normalization": "RMSNorm",
    "add_bias_linear": False, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True, "moe_layer_pattern": [1, 0],
}  # fmt: skip


def test_planner_adapts_attention_dense_mlp_and_shared_expert_only() -> None:
    m, r, h = ModelConfig(**MOE), 4, 64
    qkv, proj = r * h + (64 + 2 * 32) * r, r * h + h * r
    mlp = lambda width: r * h + 2 * width * r + r * width + h * r  # noqa: E731  (fc1 gate+up, fc2)
    assert lora_layer_params(m, r, TARGETS, layer=0) == qkv + proj + mlp(48)  # MoE layer: the shared expert
    assert lora_layer_params(m, r, TARGETS, layer=1) == qkv + proj + mlp(96)  # dense layer
    no_shared = dataclasses.replace(m, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    assert lora_layer_params(no_shared, r, TARGETS, layer=0) == qkv + proj


def test_mlp_targets_that_adapt_nothing_are_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"sft\.peft\.target_modules=.*routed experts, which LoRA does not adapt"
    ):
        compose_config(["experiment=mixtral-8x7b-sft", "sft.peft.method=lora"])
    cfg = compose_config(["experiment=mixtral-8x7b-lora"])  # attention only: fine
    assert cfg.sft.peft.target_modules == ["linear_qkv", "linear_proj"]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_lora_on_moe_ep2_matches_ep1(tmp_path: Path) -> None:
    from tests.support.metrics import FP32_REL, max_rel_delta

    spec = {
        "model": MOE,
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
        "stage": {"iters": 4, "lr": 1e-2, "min_lr": 1e-3},
        "samples": 8,
        "peft": {"method": "lora", "rank": 4, "alpha": 16.0, "target_modules": TARGETS},
    }
    one = launch(1, spec, tmp_path / "ep1")
    two = launch(2, {**spec, "parallel": {**spec["parallel"], "ep": 2}}, tmp_path / "ep2")
    got, want = [h["loss"] for h in two["history"]], [h["loss"] for h in one["history"]]
    assert max_rel_delta(got, want) < FP32_REL, (got, want)
    assert want[-1] < want[0]
    m = ModelConfig(**MOE)
    planned = sum(lora_layer_params(m, 4, TARGETS, layer=i) for i in range(2))
    assert one["trainable_rank0"] == two["trainable_rank0"] == planned  # no adapter on a routed expert
    shutil.rmtree(tmp_path, ignore_errors=True)
