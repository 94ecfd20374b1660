"""The planner on Qwen3 and Mixture-of-Experts models: total and active parameters from config.json against
the published counts and transformers' own count, a MoE GPTModel of megatron-core counted on the meta device,
memory per rank with expert parallelism, FLOPs of the active parameters and the dispatch volume by hand, and
every shipped MoE/Qwen3 recipe fitting its H100 nodes with headroom."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.cli.plan import CONF_DIR, compose_config, main
from pipeline.schema.config import ModelConfig
from pipeline.schema.estimates import GiB, estimate_stage, rank_memory, step_flops
from pipeline.schema.hf_arch import arch_values
from pipeline.schema.moe_sizes import dispatch_bytes, expert_params, rank_layers
from pipeline.schema.params import active_param_count, config_vocab, param_count, rank_param_split
from pipeline.schema.sections import ParallelConfig
from tests.support.env import REPO
from tests.support.timing import scaled

# config.json of the published checkpoints, as Qwen and Mistral AI publish them (fields the mapping reads).
QWEN3 = {
    "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
    "max_position_embeddings": 40960,
}  # fmt: skip
QWEN3_MOE = {
    **QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}  # fmt: skip
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        **QWEN3, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "max_window_layers": 36,
    },
    "qwen3-30b-a3b": {
        **QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
    },
    "qwen3-235b-a22b": {
        **QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_attention_heads": 64, "num_hidden_layers": 94, "num_key_value_heads": 4,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
    },
}  # fmt: skip
# (total, active) as published, each with the unit it is given in: model cards of Qwen3 ("8.2B"; "30.5B in
# total and 3.3B activated"; "235B ... 22B") and Mistral AI's Mixtral announcement (46.7B, 12.9B per token).
PUBLISHED_COUNTS = {
    "qwen3-8b": ((8.2e9, 1e8), (8.2e9, 1e8)),
    "qwen3-30b-a3b": ((30.5e9, 1e8), (3.3e9, 1e8)),
    "qwen3-235b-a22b": ((235e9, 1e9), (22e9, 1e9)),
    "mixtral-8x7b": ((46.7e9, 1e8), (12.9e9, 1e8)),
}
# The exact counts (totals equal transformers' count of the same config.json, test below).
EXACT = {
    "qwen3-8b": (8_190_735_360, 8_190_735_360),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
}


def published_model(name: str) -> ModelConfig:
    return ModelConfig(name=name, seq_length=4096, **arch_values(PUBLISHED[name]))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_match_the_published_counts(name: str) -> None:
    model = published_model(name)
    total, active = param_count(model), active_param_count(model)
    assert (total, active) == EXACT[name]
    for kind, count, (published, unit) in zip(("total", "active"), (total, active), PUBLISHED_COUNTS[name]):
        # within 0.5%, except Qwen3's two active counts (3.353B, 22.19B), which the cards truncate to their
        # unit (3.3B, 22B): within 1.6% and 0.9%, and the exact count truncated is the published figure
        truncated = count // unit * unit == published
        assert count == pytest.approx(published, rel=0.005) or (truncated and kind == "active"), (kind, count)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_counts_equal_transformers_on_the_meta_device() -> None:
    """Totals: every parameter of transformers' model of the same config.json; active: that minus the
    experts a token skips (num_experts - top-k of each MoE layer's, sized from transformers' own tensors)."""
    code = textwrap.dedent(
        """
        import json, sys, warnings
        warnings.filterwarnings("ignore")
        import torch, transformers
        out = {}
        for name, hf in json.loads(sys.argv[1]).items():
            prefix = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[hf["model_type"]]
            cfg = getattr(transformers, prefix + "Config")(**{k: v for k, v in hf.items() if k != "model_type"})
            with torch.device("meta"):
                model = getattr(transformers, prefix + "ForCausalLM")(cfg)
            total = sum(p.numel() for p in model.parameters())
            skipped = 0
            for n, p in model.named_parameters():
                if ".experts." in n:  # fused [experts, ...] tensors in transformers 5
                    skipped += p.numel() // p.shape[0] * (p.shape[0] - hf["num_experts_per_tok"])
            out[name] = [total, total - skipped]
        print(json.dumps(out))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(PUBLISHED)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert {k: tuple(v) for k, v in got.items()} == EXACT


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_shipped_model_configs_are_the_published_config_json(name: str) -> None:
    shipped = compose_config([f"model={name}"]).model
    values = arch_values(PUBLISHED[name])
    assert {k: getattr(shipped, k) for k in values} == values
    assert param_count(shipped) == EXACT[name][0]


_MEGATRON_MOE = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
    parallel_state.initialize_model_parallel(1, 1)
    m = json.loads(sys.argv[2])
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], ffn_hidden_size=m["ffn_hidden_size"], kv_channels=m["kv_channels"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, num_moe_experts=m["num_experts"],
        moe_router_topk=m["moe_router_topk"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
        moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"],
        moe_shared_expert_gate=True, moe_layer_freq=m["moe_layer_pattern"], use_cpu_initialization=True,
        perform_initialization=False,
    )
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    with torch.device("meta"):
        model = GPTModel(cfg, spec, vocab_size=m["vocab_size"], max_sequence_length=64,
                         position_embedding_type="rope", share_embeddings_and_output_weights=False)
    print(sum(p.numel() for p in model.parameters()))
    """
)

TINY_MOE = ModelConfig(
    num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24, ffn_hidden_size=96,
    seq_length=32, vocab_size=1000, normalization="RMSNorm", activation="swiglu", position_embedding="rope",
    add_bias_linear=False, add_qkv_bias=True, tie_embeddings=False, qk_layernorm=True, num_experts=4, moe_router_topk=2,
    moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
    moe_layer_pattern=[1, 0, 1],
)  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_moe_param_count_matches_megatron_gptmodel(tmp_path: Path) -> None:
    """q/k/v biases, q/k norms, routed experts, a gated shared expert and a dense layer between MoE layers."""
    done = subprocess.run(
        [sys.executable, "-c", _MEGATRON_MOE, str(tmp_path / "store"), json.dumps(dataclasses.asdict(TINY_MOE))],
        capture_output=True, text=True, timeout=scaled(300), cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) == param_count(TINY_MOE)


def test_moe_layer_params_by_hand() -> None:
    h, kv = 64, 24
    attention = (
        (h + 1) * (4 * kv + 2 * 2 * kv) + 4 * kv * h + 2 * h + 2 * kv
    )  # qkv + bias, proj, norms, q/k norms
    expert = h * 2 * 32 + 32 * h
    shared = h * 2 * 48 + 48 * h + h  # with its gate
    moe = attention + 4 * h + 4 * expert + shared  # router, 4 experts
    dense = attention + h * 2 * 96 + 96 * h
    outer = 1000 * h * 2 + h  # embeddings, output layer, final norm
    assert expert_params(TINY_MOE) == expert
    assert param_count(TINY_MOE) == 2 * moe + dense + outer
    assert active_param_count(TINY_MOE) == 2 * (moe - 2 * expert) + dense + outer  # top-2 of 4
    # tp 2, ep 2, etp 1 on pp rank 0 of pp 1: experts 2 of 4 unsplit, the rest split over tp 2
    rest, experts = rank_param_split(TINY_MOE, 1024, tp=2, pp=1, pp_rank=0, ep=2, etp=1)
    assert experts == 2 * (2 * expert)
    assert rank_param_split(TINY_MOE, 1024, tp=1, pp=1, pp_rank=0, ep=4, etp=1)[1] == 2 * expert
    assert rank_param_split(TINY_MOE, 1024, tp=2, pp=1, pp_rank=0, ep=1, etp=2)[1] == 2 * 4 * expert // 2
    assert rank_layers(8, 2, 2, 1) == [2, 3, 6, 7]  # vpp: chunk c of rank r at c x L/vpp + r x L/(vpp pp)


def test_expert_optimizer_state_shards_over_the_expert_data_parallel_ranks() -> None:
    par = ParallelConfig(
        tp=2,
        ep=4,
        etp=1,
        micro_batch_size=1,
        global_batch_size=8,
        precision="bf16",
        distributed_optimizer=True,
    )
    dense, experts = rank_param_split(TINY_MOE, 1024, tp=2, pp=1, pp_rank=0, ep=4, etp=1)
    mem = rank_memory(TINY_MOE, par, 4, 1024, 0, 2)  # dp 4: tp x dp = 8 ranks, experts' dp 8 / (4 x 1) = 2
    assert mem.expert_params == experts and mem.params == dense + experts
    assert (mem.weights, mem.gradients) == (2 * (dense + experts), 4 * (dense + experts))
    assert mem.optimizer == 12 * dense // 4 + 12 * experts // 2


def test_moe_flops_count_the_active_parameters() -> None:
    """A top-1 MoE with experts of width f costs a dense model of width f plus the router."""
    dense = dataclasses.replace(
        TINY_MOE, num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_layer_pattern=[],
        moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, ffn_hidden_size=32,
    )  # fmt: skip
    moe = dataclasses.replace(
        TINY_MOE, moe_router_topk=1, moe_router_norm_topk=False, moe_layer_pattern=[], ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
    )  # fmt: skip
    tokens = 4 * 32
    router = 3 * 2 * 64 * 4 * tokens * 3  # forward 2 h E per token and layer, x3 with the backward
    assert step_flops(moe, 1000, 4)[0] == pytest.approx(step_flops(dense, 1000, 4)[0] + router, rel=1e-12)


def test_dispatch_volume_by_hand() -> None:
    par = ParallelConfig(ep=2, micro_batch_size=2, global_batch_size=8, precision="bf16")
    # 2 MoE layers x 4 micro batches x 4 exchanges x (64 tokens x top-2 x 1/2 to the other rank) x h 64 x 2 B
    assert dispatch_bytes(TINY_MOE, par, 0, 4) == 2 * 4 * 4 * 64 * 2 // 2 * 64 * 2
    gather = dataclasses.replace(par, moe_token_dispatcher="allgather")
    assert dispatch_bytes(TINY_MOE, gather, 0, 4) == 2 * 4 * 4 * 64 * 64 * 2
    assert dispatch_bytes(TINY_MOE, dataclasses.replace(par, ep=1), 0, 4) == 0


# The published-model recipes (cluster=gpu_ib); tiny and moe-tiny are laptop experiments.
RECIPES = [p.stem for p in sorted((CONF_DIR / "experiment").glob("*.yaml")) if not p.stem.endswith("tiny")]


def test_every_qwen3_and_moe_model_has_full_and_lora_recipes() -> None:
    for model in ("qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b"):
        assert {f"{model}-sft", f"{model}-lora"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_fits_its_nodes_with_headroom(recipe: str) -> None:
    cfg = compose_config([f"experiment={recipe}"])
    raw = yaml.safe_load((CONF_DIR / "experiment" / f"{recipe}.yaml").read_text())
    assert cfg.cluster.gpus_per_node == 8 and cfg.cluster.executor == "slurm"  # cluster=gpu_ib
    assert (cfg.sft.peft.method == "lora") == recipe.endswith("-lora")
    est = estimate_stage(cfg, "sft")
    assert est.capacity is not None
    assert est.peak_bytes <= 0.85 * est.capacity, (
        f"{est.peak_bytes / GiB:.1f} GiB of {est.capacity / GiB:.1f}"
    )
    assert est.plan.nodes == raw["sft"]["parallel"]["nodes"]
    if cfg.model.num_experts:
        assert est.plan.ep > 1 and est.peak.expert_params > 0


def test_cli_prints_active_parameters_and_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment=qwen3-30b-a3b-sft"]) == 0
    out = capsys.readouterr().out
    assert "30,532,122,624 parameters (30.53 B), 3,353,032,704 active per token" in out
    assert "top-8 of 128 experts of width 768 in 48 of 48 layers" in out
    assert "ep=8 etp=1 (alltoall dispatch): 16 ranks on 2 node(s)" in out
    assert "of which routed experts (/ ep 8 x etp 1)" in out and "MoE token dispatch" in out


def test_recipe_plans_from_a_published_config_json(tmp_path: Path) -> None:
    """experiment=qwen3-30b-a3b-sft with sft.init_from=hf:<dir>: the shipped shapes agree with config.json."""
    from tests.support.hf_models import make_tokenizer

    hf = tmp_path / "Qwen3-30B-A3B"
    make_tokenizer(hf)
    (hf / "config.json").write_text(json.dumps(PUBLISHED["qwen3-30b-a3b"]))
    over = ["experiment=qwen3-30b-a3b-sft", f"sft.init_from=hf:{hf}"]
    est = estimate_stage(compose_config(over), "sft")
    assert est.model.num_experts == 128 and est.fits
    with pytest.raises(Exception, match=r"model\.moe_router_topk=4: contradicts"):
        compose_config([*over, "model.moe_router_topk=4"])


def test_a_moe_layout_that_does_not_fit_suggests_more_expert_parallelism() -> None:
    over = ["experiment=qwen3-30b-a3b-sft", "sft.parallel.ep=1", "sft.parallel.pp=1"]
    est = estimate_stage(compose_config(over), "sft")
    assert not est.fits and est.suggestion is not None and "sft.parallel.ep=" in est.suggestion
    fix = est.suggestion.split(" (")[0].split()
    assert estimate_stage(compose_config(over + fix), "sft").fits


# ---------------------------------------------------------------------------- a folder holding config.json alone


def _small(name: str, **fields: Any) -> dict[str, Any]:
    """``name``'s published config.json, every field kept, at laptop sizes (2 layers, hidden 64, 4 experts,
    top-2)."""
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    return {**PUBLISHED[name], **shape, "num_experts_per_tok": 2, "vocab_size": 323, **fields}


SMALL_MOE = {
    "Mixtral": _small("mixtral-8x7b", intermediate_size=32, num_local_experts=4),
    "Qwen3-MoE": _small(
        "qwen3-30b-a3b", head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=4
    ),
}


def _plan(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], tuple[int, int]]:
    """The printed plan of ``sft.init_from=hf:<folder>`` (it fits) and (total, active) parameters."""
    over = [f"sft.init_from=hf:{folder}", "run.stages=[sft]"]
    assert main(over) == 0
    cfg = compose_config(over)
    counts = (param_count(cfg.model, config_vocab(cfg)), active_param_count(cfg.model, config_vocab(cfg)))
    return capsys.readouterr().out.splitlines(), counts


@pytest.mark.parametrize("family", sorted(SMALL_MOE))
def test_plan_of_config_json_alone_counts_as_the_full_folder(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder holding config.json alone plans and names what a run will also need; its total and active
    parameters (and the whole model line) are those of the same config.json with the tokenizer files."""
    from tests.support.hf_models import make_tokenizer

    alone, full = tmp_path / "alone" / family, tmp_path / "full" / family
    for folder in (alone, full):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(SMALL_MOE[family]))
    assert make_tokenizer(full) <= SMALL_MOE[family]["vocab_size"]
    out, counts = _plan(alone, capsys)
    full_out, full_counts = _plan(full, capsys)
    assert counts == full_counts and 0 < counts[1] < counts[0]
    assert out[0] == full_out[0] and f"{counts[0]:,} parameters" in out[0]
    assert f"{counts[1]:,} active per token" in out[0] and "top-2 of 4 experts of width 32" in out[0]
    need = [line for line in out if "a run will also need" in line]
    assert need == [
        f"planned from {alone / 'config.json'} alone: a run will also need its tokenizer (tokenizer.json) "
        f"and its weights (*.safetensors) in {alone}"
    ]
    assert [line.split(": ", 1)[1] for line in full_out if "a run will also need" in line] == [
        f"a run will also need its weights (*.safetensors) in {full}"
    ]


def test_cheapest_change_of_an_fp32_layout_includes_bf16(tmp_path: Path) -> None:
    """Mixtral-8x7B's config.json alone on two 8-GPU nodes with the defaults (fp32): 698 GiB per GPU; the
    cheapest change that fits starts with bf16 (before precision was a candidate: distributed optimizer, pp 2
    and ep 4), and fits. A stage already in bf16 is not offered a precision."""
    folder = tmp_path / "Mixtral-8x7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PUBLISHED["mixtral-8x7b"]))
    over = [f"sft.init_from=hf:{folder}", "cluster=gpu_ib", "run.stages=[sft]", "sft.parallel.nodes=2"]
    over += ["sft.parallel.micro_batch_size=1"]
    est = estimate_stage(compose_config(over), "sft")
    assert est.parallel.precision == "fp32" and not est.fits and round(est.peak_bytes / GiB) == 698
    assert est.suggestion is not None
    fix = est.suggestion.split(" (")[0].split()  # as docs/parallel.md quotes it
    assert fix == [
        "sft.parallel.precision=bf16",
        "sft.parallel.distributed_optimizer=true",
        "sft.parallel.ep=8",
    ] and est.suggestion.endswith("(then 74.0 GiB per GPU)")
    assert estimate_stage(compose_config(over + fix), "sft").fits
    bf16 = estimate_stage(compose_config([*over, "sft.parallel.precision=bf16"]), "sft")
    assert bf16.suggestion is not None and "precision" not in bf16.suggestion
