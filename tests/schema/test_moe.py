"""Mixture of Experts in the schema: every MoE relation fails before any job naming its key, EP in the plan,
and a dense model's run hash unchanged by the new keys."""

from __future__ import annotations

import pytest

from pipeline.schema.compose import load_config
from pipeline.schema.errors import ConfigError
from pipeline.schema.identity import run_hash, stage_hashes
from pipeline.schema.layout import stage_plan
from pipeline.schema.moe import moe_layers

MOE = ["model.num_experts=4", "model.moe_router_topk=2"]
DP2 = ["pretrain.parallel.dp=2"]

BAD = [
    (["model.moe_router_topk=3"], "model.moe_router_topk=3: a MoE setting, but num_experts=None"),
    (["model.num_experts=2", "model.moe_router_topk=3"], "model.moe_router_topk=3: must be <= num_experts=2"),
    (["model.num_experts=-1"], "model.num_experts=-1: must be 0 (off) or an integer >= 1"),
    (
        [*MOE, "model.moe_router_score_function=tanh"],
        "model.moe_router_score_function='tanh': must be one of",
    ),
    ([*MOE, "model.moe_router_load_balancing_type=sinkhorn"], "model.moe_router_load_balancing_type="),
    ([*MOE, "model.moe_router_dtype=bf16"], "model.moe_router_dtype='bf16'"),
    ([*MOE, "model.moe_router_topk=1"], "model.moe_router_norm_topk=True: with top-k 1"),
    (
        [*MOE, "model.moe_router_score_function=sigmoid", "model.moe_router_norm_topk=false"],
        "model.moe_router_norm_topk=False: moe_router_score_function=sigmoid",
    ),
    (
        [*MOE, "model.moe_shared_expert_gate=true"],
        "model.moe_shared_expert_gate=True: gates the shared expert",
    ),
    (
        [*MOE, "model.moe_shared_expert_intermediate_size=64"],
        "model.moe_shared_expert_intermediate_size=64: megatron-core's shared expert has no biases",
    ),
    ([*MOE, "model.moe_layer_pattern=[1,0,1]"], "model.moe_layer_pattern=[1, 0, 1]: must list num_layers=4"),
    ([*MOE, "model.moe_layer_pattern=[0,0,0,0]"], "model.moe_layer_pattern=[0, 0, 0, 0]: no MoE layer"),
    ([*MOE, "model.moe_layer_pattern=[1,0,1,0]", "model.moe_layer_freq=2"], "model.moe_layer_pattern="),
    ([*MOE, "model.moe_layer_freq=5"], "model.moe_layer_freq=5: must be <= num_layers=4"),
    ([*MOE, "model.moe_expert_capacity_factor=0"], "model.moe_expert_capacity_factor=0"),
    (
        [*MOE, "model.moe_router_load_balancing_type=none", "model.moe_aux_loss_coeff=0.1"],
        "model.moe_aux_loss_coeff=0.1: moe_router_load_balancing_type=none",
    ),
    ([*DP2, "pretrain.parallel.ep=2"], "pretrain.parallel.ep=2: expert parallelism needs experts"),
    (["pretrain.parallel.etp=1"], "pretrain.parallel.etp=1: expert parallelism needs experts"),
    (
        ["model.num_experts=6", *DP2, "pretrain.parallel.dp=4", "pretrain.parallel.ep=4"],
        "pretrain.parallel.ep=4: does not divide the 6 experts of model.num_experts",
    ),
    (
        ["model.num_experts=8", "pretrain.parallel.dp=1", "pretrain.parallel.ep=2"],
        "pretrain.parallel.ep=2: ep x etp = 2 x 1 must divide tp x dp = 1",
    ),
    (
        [*MOE, "model.add_bias_linear=false", "pretrain.parallel.tp=2", "pretrain.parallel.dp=1"]
        + ["pretrain.parallel.ep=2"],
        "pretrain.parallel.ep=2: ep x etp = 2 x 2 must divide tp x dp = 2",
    ),
    (
        [*MOE, "model.moe_ffn_hidden_size=63", "pretrain.parallel.tp=2"],
        "pretrain.parallel.etp=2: the expert width 63",
    ),
    (
        [
            *MOE,
            "model.add_bias_linear=false",
            "model.moe_shared_expert_intermediate_size=63",
            "pretrain.parallel.tp=2",
            "pretrain.parallel.etp=1",
        ],
        "pretrain.parallel.tp=2: model.moe_shared_expert_intermediate_size=63",
    ),
    (
        [*MOE, "pretrain.parallel.tp=2"],
        "pretrain.parallel.etp=2: megatron-core supports biases in experts only with etp=1",
    ),
    (
        [*MOE, "model.add_bias_linear=false", "pretrain.parallel.tp=2"],
        "pretrain.parallel.tp=2: megatron-core's MoE layer trains with tensor parallelism only together with",
    ),
    (["sft.parallel.moe_token_dispatcher=a2a"], "sft.parallel.moe_token_dispatcher='a2a'"),
    ([*MOE, "data_prep.parallel.ep=2"], "data_prep.parallel.ep=2: data_prep does not read it"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_moe_config_names_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert str(e.value).startswith(message), str(e.value)


def test_ep_in_the_plan_adds_no_ranks() -> None:
    cfg = load_config([*MOE, "pretrain.parallel.dp=2", "pretrain.parallel.ep=2"])
    p = stage_plan(cfg, "pretrain")
    assert (p.world_size, p.dp, p.ep, p.etp, p.nodes, p.tasks_per_node) == (2, 2, 2, 1, 1, 2)
    # tensor parallel MoE training needs sequence parallel (Transformer Engine): the plan alone, unvalidated
    only_prep = [*MOE, "model.add_bias_linear=false", "run.stages=[data_prep]", "pretrain.parallel.tp=2"]
    cfg = load_config([*only_prep, "pretrain.parallel.dp=2", "pretrain.parallel.ep=2"])
    plan = stage_plan(cfg, "pretrain")
    assert (plan.world_size, plan.ep, plan.etp, plan.nodes) == (4, 2, 2, 2)  # ranks_per_node=2
    cfg = load_config([*only_prep, "pretrain.parallel.ep=2", "pretrain.parallel.etp=1"])
    assert stage_plan(cfg, "pretrain").world_size == 2  # EP2 over the two tensor-parallel ranks


def test_ep_alone_derives_the_data_parallel_ranks() -> None:
    plan = stage_plan(load_config([*MOE, "pretrain.parallel.ep=2"]), "pretrain")
    assert (plan.dp, plan.ep, plan.world_size) == (2, 2, 2)
    assert stage_plan(load_config(MOE), "pretrain").dp == 1
    with pytest.raises(ConfigError, match=r"^pretrain.parallel.ep=3: does not divide the 4 experts of model"):
        load_config([*MOE, "pretrain.parallel.ep=3"])


def test_moe_layers() -> None:
    assert moe_layers(load_config([*MOE, "model.moe_layer_freq=2"]).model) == [True, False, True, False]
    pattern = load_config([*MOE, "model.moe_layer_pattern=[0,1,1,1]"]).model
    assert moe_layers(pattern) == [False, True, True, True]
    assert moe_layers(load_config([]).model) == [False] * 4


def test_dense_hash_unchanged_by_the_moe_keys() -> None:
    # The hashes of these configs before the MoE keys existed (computed on the parent commit).
    assert run_hash(load_config([])) == "782a17f8"
    assert run_hash(load_config(["experiment=tiny"])) == "d540db3a"
    assert stage_hashes(load_config(["model=llama3.2-1b"]), with_inputs=False)["pretrain"] == "6ff62655d016"
    assert run_hash(load_config(["model.num_experts=0"])) == "782a17f8"  # 0 and None are both dense
    base = run_hash(load_config(MOE))
    assert base != "782a17f8"
    assert run_hash(load_config([*MOE, "pretrain.parallel.dp=2", "pretrain.parallel.ep=2"])) == base  # layout
    assert run_hash(load_config([*MOE, "model.moe_aux_loss_coeff=0.02"])) != base
    assert run_hash(load_config(["model.qk_layernorm=true"])) != "782a17f8"


def test_layer_pattern_entries_have_a_domain() -> None:
    with pytest.raises(
        ConfigError, match=r"^model.moe_layer_pattern=\[1, 2, 1, 1\]: each entry must be an integer"
    ):
        load_config([*MOE, "model.moe_layer_pattern=[1,2,1,1]"])
