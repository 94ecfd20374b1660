"""Mixture of Experts on megatron-core with gloo: every layout starts from one rank's weights bit for bit
(experts drawn by global expert index) and trains like one rank, the routing metrics agree across layouts,
and the routing-collapse alarm fires.

Runs are fresh process groups in subprocesses (tests/support/engine_worker.py), compared as in
tests/engine/train/test_parallel.py (same tolerance). Tensor parallelism with MoE needs sequence parallel
(Transformer Engine): a config error here, not a layout to test on CPU (tests/schema/test_moe.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.callbacks.alarms import ROUTING_COLLAPSE, Alarms
from pipeline.schema.stage_sections import MonitorConfig
from tests.engine.train.test_parallel import full_weights, torch_equal
from tests.support.engine_worker import launch
from tests.support.metrics import FP32_REL, max_rel_delta

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_z_loss_coeff": 1e-3}
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, **MOE}
STEPS = 4


def spec(parallel: dict[str, Any] | None = None, model: dict[str, Any] | None = None, **over: Any) -> dict:
    return {
        "model": {**MODEL, **(model or {})},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8, **(parallel or {})},
        "stage": {"iters": STEPS, "lr": 3e-3, "min_lr": 3e-4},
        "samples": 64,
        **over,
    }


def world(par: dict[str, Any]) -> int:
    return par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)


def history(result: dict[str, Any], key: str) -> list[float]:
    return [h[key] for h in result["history"]]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One rank, EP1: its history and its initial weights (a checkpoint at iteration 0)."""
    tmp = tmp_path_factory.mktemp("moe-baseline")
    return launch(1, spec(save_weights=str(tmp / "w")), tmp / "run"), tmp / "w"


LAYOUTS = {
    "ep2": {"dp": 2, "ep": 2},
    "ep2-allgather": {"dp": 2, "ep": 2, "moe_token_dispatcher": "allgather"},
    "pp2": {"pp": 2},
    "pp2-ep2-distopt": {"pp": 2, "dp": 2, "ep": 2, "distributed_optimizer": True},
}


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_starts_from_the_same_weights_and_trains_like_one_rank(
    layout: str, baseline: tuple[dict, Path], tmp_path: Path
) -> None:
    par = LAYOUTS[layout]
    result = launch(world(par), spec(par, save_weights=str(tmp_path / "w")), tmp_path / "run")
    want = full_weights(baseline[1], tmp_path / "one.pt")
    got = full_weights(tmp_path / "w", tmp_path / "layout.pt")
    assert sorted(got) == sorted(want)
    assert any(".experts." in k for k in want), sorted(want)
    differ = [k for k in want if not torch_equal(got[k], want[k])]
    assert not differ, f"{layout}: initial weights differ from one rank's in {differ}"
    base = baseline[0]
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_layer1_tokens_max", "moe_layer0_tokens_entropy"):
        delta = max_rel_delta(history(result, key), history(base, key))
        print(f"{layout}: {key} max relative delta over {STEPS} steps = {delta:.2e}")
        assert delta < FP32_REL, (key, history(result, key), history(base, key))


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_dense_and_moe_layers_mixed_over_pipeline_stages(tmp_path: Path) -> None:
    """moe_layer_pattern: layers 0 and 3 MoE, 1 and 2 dense; pp2 puts one of each on every stage."""
    model = {"num_layers": 4, "moe_layer_pattern": [1, 0, 0, 1]}
    one = launch(1, spec(model=model), tmp_path / "one")
    two = launch(2, spec({"pp": 2}, model=model), tmp_path / "pp2")
    assert max_rel_delta(history(two, "loss"), history(one, "loss")) < FP32_REL
    assert {"moe_layer0_tokens_max", "moe_layer3_tokens_max"} <= set(one["history"][0])
    assert "moe_layer1_tokens_max" not in one["history"][0]
    assert history(two, "moe_layer3_tokens_min") == pytest.approx(history(one, "moe_layer3_tokens_min"))


def test_capacity_factor_drops_tokens_and_the_metrics_say_so(tmp_path: Path) -> None:
    dropping = launch(1, spec(model={"moe_expert_capacity_factor": 1.0}, stage={"iters": 1}), tmp_path / "cf")
    line = dropping["history"][0]
    assert 0 < line["moe_dropped_frac"] < 1
    assert line["moe_layer0_tokens_max"] <= 0.5  # capacity: tokens x top-k / experts x 1.0 = half the tokens
    assert launch(1, spec(stage={"iters": 1}), tmp_path / "none")["history"][0]["moe_dropped_frac"] == 0


def test_routing_collapse_alarm_fires_after_n_logged_lines() -> None:
    out: list[dict[str, Any]] = []
    alarms = Alarms(MonitorConfig(alarm_routing_collapse=0.9, alarm_routing_steps=3), out.append)
    balanced = {"moe_layer0_tokens_max": 0.55, "moe_layer0_tokens_min": 0.45}
    collapsed = {"moe_layer0_tokens_max": 0.97, "moe_layer0_tokens_min": 0.01}
    for step, line in enumerate([collapsed, collapsed, balanced, collapsed, collapsed, collapsed, collapsed]):
        alarms.check(step, {**balanced, "moe_layer1_tokens_max": 0.5, **line})
    assert [(a["alarm"], a["step"]) for a in out] == [(ROUTING_COLLAPSE, 5)]
    assert "MoE layer 0" in out[0]["message"] and out[0]["value"] == 0.97
    everyone = {"moe_layer0_tokens_max": 1.0, "moe_layer0_tokens_min": 1.0}  # top-2 of 2 experts
    for step in range(5):
        alarms.check(10 + step, everyone)
    assert len(out) == 1


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_lora_on_a_moe_model_adapts_attention_and_dense_linears_at_any_ep(tmp_path: Path) -> None:
    lora = {
        "method": "lora",
        "rank": 4,
        "alpha": 8.0,
        "target_modules": ["linear_qkv", "linear_fc1", "linear_fc2"],
    }
    model = {
        "moe_shared_expert_intermediate_size": 64,
        "moe_shared_expert_gate": True,
        "add_bias_linear": False,
    }
    one = launch(1, spec(model=model, peft=lora, stage={"iters": 3, "lr": 1e-2}), tmp_path / "one")
    two = launch(
        2, spec({"dp": 2, "ep": 2}, model=model, peft=lora, stage={"iters": 3, "lr": 1e-2}), tmp_path / "ep2"
    )
    # adapters: 2 layers x (qkv + shared expert fc1, fc2) x (A, B); experts and router frozen
    assert one["trainable_rank0"] == two["trainable_rank0"] > 0
    losses = history(one, "loss")
    assert losses[-1] < losses[0]
    assert max_rel_delta(history(two, "loss"), losses) < FP32_REL
