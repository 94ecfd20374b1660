"""Qwen3 and the Mixture-of-Experts families in and out: small random Qwen3, Qwen3-MoE, Mixtral and Qwen2-MoE
models built with transformers, imported under TP1, TP2, PP2, EP2 and TP2 x EP2, give transformers' logits
(fp32, 1e-5 relative); import then export without training gives bit-identical tensors that transformers
reloads to the same logits; unsupported routers and features in config.json fail naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.cli.compose import load
from pipeline.schema.errors import ConfigError
from pipeline.schema.hf_arch import HFConfigError, arch_values, model_config, to_hf_config
from pipeline.schema.moe import moe_layers
from pipeline.schema.moe_sizes import expert_params
from pipeline.schema.params import param_count
from tests.engine.models.test_hf_export import run_export, tensors
from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.hf_models import hf_logits, make

WORKER = REPO / "tests" / "support" / "hf_worker.py"
REL = 1e-5
KINDS = ("qwen3", "qwen3_moe", "mixtral", "qwen2_moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {k: make(k, root / k) for k in KINDS}


def config(models: dict[str, Path], kind: str) -> dict[str, Any]:
    return dict(json.loads((models[kind] / "config.json").read_text()))


def test_config_mapping(models: dict[str, Path]) -> None:
    qwen3 = model_config(models["qwen3"])
    assert qwen3.qk_layernorm and qwen3.kv_channels == 24 and not qwen3.num_experts
    q3m = model_config(models["qwen3_moe"])
    assert (q3m.num_experts, q3m.moe_router_topk, q3m.moe_ffn_hidden_size) == (4, 2, 32)
    assert q3m.qk_layernorm and q3m.moe_router_norm_topk and q3m.moe_layer_pattern == []
    mix = model_config(models["mixtral"])
    assert (mix.num_experts, mix.moe_ffn_hidden_size, mix.ffn_hidden_size) == (4, 32, 32)
    assert mix.moe_router_norm_topk and not mix.qk_layernorm and mix.tie_embeddings
    q2m = model_config(models["qwen2_moe"])
    assert (q2m.moe_shared_expert_intermediate_size, q2m.moe_shared_expert_gate) == (48, True)
    assert q2m.moe_layer_pattern == [1, 0] and q2m.add_qkv_bias and not q2m.moe_router_norm_topk
    for kind in KINDS:  # written back as the same family, with the same architecture
        hf = config(models, kind)
        out = to_hf_config(model_config(models[kind]), hf["vocab_size"])
        assert (out["model_type"], out["architectures"]) == (hf["model_type"], hf["architectures"])
        assert arch_values(out) == arch_values(hf), kind


def test_published_qwen3_moe_config_names_experts_num_experts() -> None:
    """Published Qwen3-MoE config.json files say num_experts (transformers 5 writes num_local_experts)."""
    hf = {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
        "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
    }  # fmt: skip
    values = arch_values(hf)
    assert (values["num_experts"], values["moe_router_topk"], values["kv_channels"]) == (128, 8, 128)
    hf["decoder_sparse_step"], hf["mlp_only_layers"] = 2, [47]
    pattern = arch_values(hf)["moe_layer_pattern"]
    assert pattern[:4] == [0, 1, 0, 1] and pattern[47] == 0 and sum(pattern) == 23


@pytest.mark.parametrize(
    "kind, field, value, says",
    [
        ("qwen3_moe", "n_group", 8, "group-limited"),
        ("qwen3_moe", "topk_group", 4, "group-limited"),
        ("qwen3_moe", "topk_method", "noaux_tc", "plain top-k"),
        ("mixtral", "scoring_func", "sigmoid", "softmax"),
        ("qwen3_moe", "routed_scaling_factor", 2.5, "scaled"),
        ("mixtral", "router_jitter_noise", 0.1, "jitter"),
        ("qwen3_moe", "shared_expert_intermediate_size", 64, "shared expert"),
        ("mixtral", "n_shared_experts", 1, "shared experts"),
        ("qwen3_moe", "num_experts_per_tok", 8, "must be <="),
        ("qwen2_moe", "mlp_only_layers", [0, 1], "no MoE layer"),
        ("qwen2_moe", "shared_expert_intermediate_size", None, "missing"),
        ("mixtral", "norm_topk_prob", False, "needs True"),
        ("qwen3", "attention_bias", True, "unsupported"),
        ("qwen3", "layer_types", ["full_attention", "sliding_attention"], "full_attention"),
        ("qwen3_moe", "model_type", "deepseek_v3", "unsupported"),
    ],
)
def test_unsupported_router_or_feature_names_the_field(
    models: dict[str, Path], kind: str, field: str, value: Any, says: str
) -> None:
    hf = {**config(models, kind), field: value}
    with pytest.raises(
        HFConfigError, match=f"{field}={value!r}".replace("[", r"\[").replace("(", r"\(")
    ) as e:
        arch_values(hf)
    assert says in str(e.value)


def test_unsupported_router_is_a_config_error_before_any_job(models: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in models["qwen3_moe"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(
        json.dumps({**config(models, "qwen3_moe"), "n_group": 8, "topk_group": 2})
    )
    with pytest.raises(ConfigError, match=r"sft\.init_from=.*n_group=8: a group-limited \(DeepSeek-style\)"):
        load([f"sft.init_from=hf:{bad}", "run.stages=[sft]"], inputs=False)


def test_moe_keys_from_config_json_through_the_front_door(models: dict[str, Path]) -> None:
    pc = load([f"sft.init_from=hf:{models['qwen2_moe']}", "run.stages=[sft]"], inputs=False)
    assert (pc.model.num_experts, pc.model.moe_layer_pattern, pc.model.moe_shared_expert_gate) == (
        4,
        [1, 0],
        True,
    )
    with pytest.raises(ConfigError, match=r"model\.num_experts=8: contradicts"):
        load(
            [f"sft.init_from=hf:{models['qwen2_moe']}", "run.stages=[sft]", "model.num_experts=8"],
            inputs=False,
        )


def tokens(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, size=(4, 24)).tolist()


def rel_diff(got: Any, want: Any) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def import_logits(hf: Path, layout: dict[str, int], toks: list[list[int]], tmp: Path) -> tuple[Any, int]:
    """(logits of ``toks`` from the model imported at ``layout``, each data-parallel rank its own rows; the
    values rank 0 read from the safetensors shards)."""
    world = layout.pop("world")
    spec = {"hf_dir": str(hf), "parallel": layout, "tokens": toks, "logits": str(tmp / "l.npy")}
    read = int(launch(world, spec, tmp / "run", script=WORKER)["read"])
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    if dp == 1:
        return np.load(tmp / "l.npy"), read
    parts = [np.load(tmp / f"l.dp{r}.npy") for r in range(dp)]
    out = np.empty((len(toks), *parts[0].shape[1:]), dtype=parts[0].dtype)
    for r, part in enumerate(parts):
        out[r::dp] = part
    return out, read


LAYOUTS = {
    "tp1": {"world": 1},
    "tp2": {"world": 2, "tp": 2},
    "pp2": {"world": 2, "pp": 2},
    "ep2": {"world": 2, "ep": 2},
    "tp2xep2": {"world": 2, "tp": 2, "ep": 2, "etp": 1},
}
CASES = [(k, lay) for k in KINDS for lay in LAYOUTS if k != "qwen3" or "ep" not in lay]


@pytest.mark.dist
@pytest.mark.parametrize("kind, layout", CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_import_matches_transformers(models: dict[str, Path], kind: str, layout: str, tmp_path: Path) -> None:
    model = model_config(models[kind])
    toks = tokens(model.vocab_size or 0)
    want = hf_logits(models[kind], toks)
    got, read = import_logits(models[kind], dict(LAYOUTS[layout]), toks, tmp_path)
    assert got.shape == want.shape
    assert rel_diff(got, want) < REL, rel_diff(got, want)
    if layout == "ep2":  # rank 0 read its own 2 of the 4 experts of each MoE layer, nothing of the others'
        others = sum(moe_layers(model)) * 2 * expert_params(model)
        assert read == param_count(model) - others, (read, param_count(model), others)


@pytest.mark.dist
def test_import_with_expert_tensor_parallel_on_4_ranks(models: dict[str, Path], tmp_path: Path) -> None:
    """tp2 x ep2 with each expert split over etp=2: 4 ranks, dp 2."""
    toks = tokens(model_config(models["qwen3_moe"]).vocab_size or 0)
    want = hf_logits(models["qwen3_moe"], toks)
    got, _ = import_logits(models["qwen3_moe"], {"world": 4, "tp": 2, "ep": 2, "etp": 2}, toks, tmp_path)
    assert rel_diff(got, want) < REL, rel_diff(got, want)


ROUNDTRIPS = {
    "qwen3": {"tp": 2},
    "qwen3_moe": {"ep": 2},
    "mixtral": {"tp": 2, "ep": 2, "etp": 1},
    "qwen2_moe": {"pp": 2},
}


@pytest.mark.dist
@pytest.mark.parametrize("kind", KINDS)
def test_import_export_is_bit_identical(models: dict[str, Path], kind: str, tmp_path: Path) -> None:
    hf, layout = models[kind], ROUNDTRIPS[kind]
    root = tmp_path / "ckpt"
    spec = {"hf_dir": str(hf), "parallel": layout, "tokens": [[1, 2, 3, 4]] * 2, "save_weights": str(root)}
    world = 2
    launch(world, spec, tmp_path / "run", script=WORKER)
    out = tmp_path / "export"
    done = run_export(hf, root, out)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["check"]["passed"] and manifest["check"]["max_rel_diff"] < 1e-5, manifest["check"]
    written = json.loads((out / "config.json").read_text())
    assert arch_values(written) == arch_values(config(models, kind))
    want, got = tensors(hf), tensors(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name  # type: ignore[attr-defined]
        assert bool((got[name] == t).all()), name  # type: ignore[operator]
    toks = tokens(model_config(hf).vocab_size or 0)
    assert np.array_equal(hf_logits(out, toks), hf_logits(hf, toks))  # reloaded by transformers: the same
