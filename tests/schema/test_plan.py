"""The planner: exact parameter counts, memory and FLOPs formulas against hand computations, the 70B plan,
fit warnings with a working suggestion, layout errors naming the key, and every model YAML composing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.cli.plan import CONF_DIR, compose_config
from pipeline.schema import layout as plan_mod
from pipeline.schema.config import ModelConfig, PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.schema.estimates import (
    GiB,
    estimate_stage,
    inflight_layers,
    layer_activation_bytes,
    rank_activation_bytes,
    step_flops,
)
from pipeline.schema.params import layer_params, padded_vocab, param_count, rank_params
from pipeline.schema.sections import ParallelConfig
from tests.support.env import REPO
from tests.support.timing import scaled

GPU_CLUSTER = ["cluster.executor=slurm", "cluster.gpus_per_node=8"]
PLAN_70B = [
    "model=llama3.1-70b",
    *GPU_CLUSTER,
    "run.stages=[pretrain]",
    "pretrain.parallel.tp=8",
    "pretrain.parallel.pp=8",
    "pretrain.parallel.nodes=64",
    "pretrain.parallel.micro_batch_size=1",
    "pretrain.parallel.global_batch_size=1024",
    "pretrain.parallel.precision=bf16",
    "pretrain.parallel.distributed_optimizer=true",
    "pretrain.parallel.recompute=selective",
]

# A small GPT for hand computations: 4 layers, h=64, 4 heads, ffn 4h=256, gelu, LayerNorm, biases, tied.
SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)


# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "name, expected",
    [("llama3.2-1b", 1_235_814_400), ("llama3.1-8b", 8_030_261_248), ("llama3.1-70b", 70_553_706_496)],
)
def test_llama_param_counts_are_exact(name: str, expected: int) -> None:
    model = compose_config([f"model={name}"]).model
    assert param_count(model) == expected


def test_small_gpt_params_by_hand() -> None:
    # per layer: qkv (64+1)*192, proj 64*64+64, fc1 (64+1)*256, fc2 256*64+64, two LayerNorms 2*(64+64)
    per_layer = 65 * 192 + (4096 + 64) + 65 * 256 + (16384 + 64) + 256
    assert layer_params(SMALL) == per_layer == 49_984
    # + word embeddings 1000*64 + positions 32*64 + final LayerNorm 128; the output layer is tied
    assert param_count(SMALL) == 4 * per_layer + 64_000 + 2048 + 128
    assert param_count(SMALL, vocab_size=10) == 4 * per_layer + 640 + 2048 + 128
    # padded for tp=2: multiple of 64 x 2 = 128 -> 1024
    assert padded_vocab(SMALL, 1000, 2) == 1024
    assert param_count(SMALL, pad_for_tp=2) == 4 * per_layer + 1024 * 64 + 2048 + 128


def test_rank_params_split_over_tp_and_pp_by_hand() -> None:
    # tp=2: qkv 65*192/2, proj 4096/2 + 64 (row bias replicated), fc1 65*256/2, fc2 16384/2 + 64, norms 256
    shard = 6240 + 2112 + 8320 + 8256 + 256
    assert layer_params(SMALL, tp=2) == shard == 25_184
    first = 2 * shard + 1024 * 64 // 2 + 32 * 64  # 2 layers, half the padded embeddings, all positions
    last = 2 * shard + 128 + 1024 * 64 // 2  # 2 layers, final norm, a copy of the tied output layer
    assert rank_params(SMALL, 1024, tp=2, pp=2, pp_rank=0) == first == 85_184
    assert rank_params(SMALL, 1024, tp=2, pp=2, pp_rank=1) == last == 83_264
    assert rank_params(SMALL, 1000, tp=1, pp=1, pp_rank=0) == param_count(SMALL)


_MEGATRON_COUNT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
    parallel_state.initialize_model_parallel(1, 1)
    counts = []
    for m in json.loads(sys.argv[2]):
        swiglu = m["activation"] == "swiglu"
        cfg = TransformerConfig(
            num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
            num_query_groups=m["num_query_groups"], ffn_hidden_size=m["ffn_hidden_size"],
            kv_channels=m["kv_channels"], normalization=m["normalization"], gated_linear_unit=swiglu,
            activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
            add_bias_linear=m["add_bias_linear"], use_cpu_initialization=True, perform_initialization=False,
        )
        with torch.device("meta"):
            model = GPTModel(
                cfg, get_gpt_layer_local_spec(normalization=m["normalization"]), vocab_size=m["vocab_size"],
                max_sequence_length=m["seq_length"], position_embedding_type=m["position_embedding"],
                share_embeddings_and_output_weights=m["tie_embeddings"],
            )
        counts.append(sum(p.numel() for p in model.parameters()))
    print(json.dumps(counts))
    """
)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_param_count_matches_megatron_gptmodel(tmp_path: Path) -> None:
    """The tiny GPT and a scaled-down Llama shape, built as megatron GPTModels on the meta device."""
    tiny = compose_config(["model=tiny"]).model
    tiny = ModelConfig(**{**tiny.__dict__, "vocab_size": 4096})
    mini_llama = ModelConfig(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=688,
        seq_length=64, vocab_size=1000, normalization="RMSNorm", activation="swiglu", position_embedding="rope",
        add_bias_linear=False, tie_embeddings=False,
    )  # fmt: skip
    models = [tiny, mini_llama]
    shapes = json.dumps([m.__dict__ for m in models])
    out = subprocess.run(
        [sys.executable, "-c", _MEGATRON_COUNT, str(tmp_path / "store"), shapes],
        capture_output=True, text=True, timeout=scaled(300), cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [param_count(m) for m in models]


# ---------------------------------------------------------------------------- memory and FLOPs


def test_layer_activations_by_hand() -> None:
    # s=32, b=2, h=64, a=4: s*b*h = 4096, 5*a*s/h = 10
    sbh = 32 * 2 * 64
    assert layer_activation_bytes(SMALL, 2, 1, "none") == sbh * (34 + 10)
    assert layer_activation_bytes(SMALL, 2, 2, "none") == sbh * (10 + 24 / 2 + 10 / 2)
    assert layer_activation_bytes(SMALL, 2, 2, "selective") == sbh * (10 + 24 / 2)
    assert layer_activation_bytes(SMALL, 2, 2, "full") == 2 * sbh
    assert layer_activation_bytes(SMALL, 2, 2, "none", sequence_parallel=True) == sbh * (34 + 10) / 2
    assert layer_activation_bytes(SMALL, 2, 2, "full", sequence_parallel=True) == sbh


def test_inflight_layers_of_1f1b_by_hand() -> None:
    # 8 layers on pp=4: 2 layers per rank; rank r holds pp - r micro batches, at most all of them
    assert inflight_layers(8, 4, None, 0, 8) == 4 * 2
    assert inflight_layers(8, 4, None, 3, 8) == 1 * 2
    assert inflight_layers(8, 4, None, 0, 2) == 2 * 2
    # interleaved vpp=2: L/pp x (pp + (pp - 1)/vpp) = 2 x (4 + 1.5) = 11 layers on the first rank
    assert inflight_layers(8, 4, 2, 0, 8) == 11


def test_rank_activations_by_hand() -> None:
    par = ParallelConfig(micro_batch_size=2, global_batch_size=4, precision="bf16")
    sbh = 32 * 2 * 64
    layers = 4 * sbh * 44  # pp=1: one micro batch in flight, 4 layers
    embedding = sbh  # dropout mask after the embeddings
    output = 4 * sbh * (1 + 1024 / 64)  # output layer input and fp32 logits
    expected = layers + embedding + output
    assert rank_activation_bytes(SMALL, par, 1024, 0, 2, "none") == expected
    fp32 = ParallelConfig(micro_batch_size=2, global_batch_size=4, precision="fp32")
    assert rank_activation_bytes(SMALL, fp32, 1024, 0, 2, "none") == 2 * expected


def test_gpt_flops_equal_the_megatron_formula() -> None:
    b, s, n, h, v = 16, 32, 4, 64, 1024
    expected = 72 * b * s * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    model, executed = step_flops(SMALL, v, b)
    assert model == pytest.approx(expected, rel=1e-12)
    assert executed == model


def test_gqa_swiglu_flops_by_hand() -> None:
    m = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        seq_length=32, vocab_size=100, activation="swiglu",
    )  # fmt: skip
    # forward per token per layer: Q 2*64*64, K and V 2*2*64*32, out 2*64*64, attention 4*s*64, MLP 2*64*256 + 2*128*64
    layer = 8192 + 8192 + 8192 + 4 * 32 * 64 + (2 * 64 * 256 + 2 * 128 * 64)
    logits = 2 * 64 * 100
    tokens = 32  # one sequence
    model, _ = step_flops(m, 100, 1)
    assert model == pytest.approx(3 * tokens * (2 * layer + logits), rel=1e-12)
    _, selective = step_flops(m, 100, 1, "selective")
    assert selective == pytest.approx(model + tokens * 2 * 4 * 32 * 64, rel=1e-12)
    _, full = step_flops(m, 100, 1, "full")
    assert full == pytest.approx(model + tokens * 2 * layer, rel=1e-12)


def test_memory_and_step_time_of_a_stage_by_hand() -> None:
    cfg = compose_config(
        [
            *GPU_CLUSTER,
            "run.stages=[pretrain]",
            "pretrain.parallel.dp=4",
            "pretrain.parallel.precision=bf16",
            "pretrain.parallel.distributed_optimizer=true",
            "pretrain.parallel.micro_batch_size=2",
            "pretrain.parallel.global_batch_size=16",
            "model.vocab_size=1000",
            "data.vocab_size=1000",
            "planner.gpu_peak_tflops=100",
            "planner.mfu=0.5",
        ]
    )
    est = estimate_stage(cfg, "pretrain")
    (rank,) = est.ranks
    params = param_count(cfg.model, pad_for_tp=1)  # 1000 -> 1024
    assert (rank.params, rank.weights, rank.gradients) == (params, 2 * params, 4 * params)
    assert rank.optimizer == 12 * params // 4
    assert est.micro_batches == 2
    flops, _ = step_flops(cfg.model, 1024, 16)
    assert est.step_time_s == pytest.approx(flops / (4 * 100e12 * 0.5))
    assert est.fits and est.warnings() == []


# ---------------------------------------------------------------------------- plans


def test_70b_plan_on_64_nodes_is_plausible() -> None:
    est = estimate_stage(compose_config(PLAN_70B), "pretrain")
    assert (est.plan.world_size, est.plan.dp, est.plan.tasks_per_node) == (512, 8, 8)
    # first pipeline rank: 10 of 80 layers over tp=8 plus an eighth of the padded embeddings, about 1.2 B
    assert est.ranks[0].params == pytest.approx(70.55e9 / 64, rel=0.1)
    assert 40 * GiB < est.peak_bytes < 76 * GiB
    assert est.fits
    tokens_per_gpu = est.tokens_per_step / est.step_time_s / 512
    assert 600 < tokens_per_gpu < 1000  # ~6 x 70.5e9 FLOPs per token at 40% of 989 TFLOP/s


def test_cli_prints_the_70b_plan_without_torch() -> None:
    """python -m pipeline.plan with torch and megatron made unimportable, as on a laptop."""
    code = (
        "import runpy, sys; sys.modules['torch'] = None; sys.modules['megatron'] = None; "
        "sys.argv = ['pipeline.plan', *sys.argv[1:]]; runpy.run_module('pipeline.plan', run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code, *PLAN_70B],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "70,553,706,496 parameters" in out.stdout
    assert "512 ranks on 64 node(s) x 8 tasks/node" in out.stdout
    assert "pp rank 0" in out.stdout and "pp rank 7" in out.stdout
    assert "fits" in out.stdout and "WARNING" not in out.stdout


def test_layout_that_does_not_fit_warns_with_a_suggestion_that_fits() -> None:
    overrides = [
        "model=llama3.1-8b",
        *GPU_CLUSTER,
        "run.stages=[pretrain]",
        "pretrain.parallel.nodes=1",
        "pretrain.parallel.micro_batch_size=1",
        "pretrain.parallel.global_batch_size=64",
        "pretrain.parallel.precision=bf16",
    ]
    est = estimate_stage(compose_config(overrides), "pretrain")
    assert not est.fits
    (warning,) = est.warnings()
    assert "pretrain: needs" in warning and "cheapest change that fits: pretrain.parallel." in warning
    assert est.suggestion is not None
    fix = est.suggestion.split(" (")[0].split()
    assert estimate_stage(compose_config(overrides + fix), "pretrain").fits


def test_bf16_is_the_cheapest_change_of_an_fp32_layout_when_it_fits() -> None:
    """fp32 with activations over the GPU (123 GiB): bf16 alone halves them and fits (73 GiB), cheaper than
    selective recompute, which the search proposed before precision was a candidate."""
    overrides = ["model=llama3.2-1b", "model.seq_length=2048", "cluster=gpu_ib", "run.stages=[pretrain]"]
    overrides += ["pretrain.parallel.nodes=1", "pretrain.parallel.micro_batch_size=4"]
    overrides += ["pretrain.parallel.global_batch_size=64"]
    est = estimate_stage(compose_config(overrides), "pretrain")
    assert est.parallel.precision == "fp32" and not est.fits
    assert est.suggestion is not None and est.suggestion.startswith("pretrain.parallel.precision=bf16 (then ")
    fixed = estimate_stage(compose_config([*overrides, "pretrain.parallel.precision=bf16"]), "pretrain")
    assert fixed.fits and est.suggestion.endswith(f"(then {fixed.peak_bytes / GiB:.1f} GiB per GPU)")


def test_cli_exit_status_and_warning_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli.plan import main

    rc = main(["model=llama3.1-8b", *GPU_CLUSTER, "run.stages=[sft]", "sft.parallel.precision=bf16"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "DOES NOT FIT" in out and "WARNING: sft: needs" in out
    assert main(["pretrain.parallel.tp=3"]) == 2
    assert "pretrain.parallel.tp=3" in capsys.readouterr().err


# ---------------------------------------------------------------------------- layout errors


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["pretrain.parallel.tp=3"], "pretrain.parallel.tp=3"),  # 4 heads
        (["pretrain.parallel.pp=3"], "pretrain.parallel.pp=3"),  # 4 layers
        (["pretrain.parallel.pp=2", "pretrain.parallel.vpp=4"], "pretrain.parallel.vpp=4"),
        (
            ["pretrain.parallel.dp=2", "pretrain.parallel.global_batch_size=12"],
            "pretrain.parallel.global_batch_size",
        ),
        (["pretrain.parallel.dp=16", "pretrain.parallel.nodes=1"], "cluster.gpus_per_node=8"),
    ],
)
def test_layout_errors_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config([*GPU_CLUSTER, *overrides])


def test_sequence_parallel_without_transformer_engine_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "_has_transformer_engine", lambda: False)
    with pytest.raises(ConfigError, match=r"pretrain\.parallel\.sequence_parallel"):
        compose_config([*GPU_CLUSTER, "pretrain.parallel.tp=2", "pretrain.parallel.sequence_parallel=true"])


def test_planner_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"planner\.mfu"):
        compose_config(["planner.mfu=1.5"])


# ---------------------------------------------------------------------------- model YAMLs


@pytest.mark.guard
@pytest.mark.parametrize("path", sorted((CONF_DIR / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_model_yaml_composes_and_validates(path: Path) -> None:
    cfg = compose_config([f"model={path.stem}"])
    assert isinstance(cfg, PipelineConfig)
    assert cfg.model.name in (path.stem, "tiny-gpt")


def test_checkpoint_estimate_from_bytes_per_rank_and_bandwidth() -> None:
    from pipeline.schema.estimates import estimate_stage
    from pipeline.schema.params import param_count

    over = ["model=llama3.1-8b", "cluster=gpu_ib", "run.stages=[pretrain]", "pretrain.parallel.tp=8"]
    over += ["pretrain.parallel.nodes=2", "pretrain.parallel.precision=bf16", "cluster.fs_bandwidth_gb_s=4"]
    over += ["pretrain.parallel.micro_batch_size=1", "pretrain.parallel.global_batch_size=16"]
    over += ["planner.checksum_gb_s=1.5"]  # a slow hash (sha256's speed): one process is bound by it
    cfg = compose_config(over)
    ck = estimate_stage(cfg, "pretrain").checkpoint
    assert ck is not None
    params = param_count(cfg.model, pad_for_tp=8)
    assert ck.total_bytes == pytest.approx(params * (2 + 12), rel=1e-3)  # bf16 weights + fp32 main + Adam
    assert ck.rank_bytes == pytest.approx(ck.total_bytes / 8, rel=1e-3)  # tp 8, no distributed optimizer
    assert ck.save_s == pytest.approx(8 * ck.rank_bytes / 4e9)  # 8 ranks per node share 4 GB/s
    assert ck.verify_rank0_alone_s > 2 * ck.verify_s  # one process hashes 112 GB at 1.5 GB/s
