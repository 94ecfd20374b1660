"""Hugging Face models in: a Llama-3-style and a Qwen2-style random model, imported under TP1, TP2 and PP2,
give transformers' logits (fp32, 1e-5 relative); config.json maps to the model config, unsupported fields fail
naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.schema.hf_arch import HFConfigError, arch_values, model_config
from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.hf_models import hf_logits, make

WORKER = REPO / "tests" / "support" / "hf_worker.py"
REL = 1e-5


def tokens(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, size=(2, 24)).tolist()


def rel_diff(got: Any, want: Any) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {k: make(k, root / k) for k in ("llama3", "qwen2")}


def test_config_mapping(models: dict[str, Path]) -> None:
    llama = model_config(models["llama3"])
    assert (llama.num_query_groups, llama.kv_channels, llama.ffn_hidden_size) == (2, 16, 96)
    assert llama.rotary_scaling and llama.rotary_scaling_factor == 32.0
    assert llama.rotary_original_max_positions == 16 and llama.rotary_base == 500000
    assert not llama.tie_embeddings and not llama.add_qkv_bias and llama.normalization == "RMSNorm"
    qwen = model_config(models["qwen2"])
    assert qwen.tie_embeddings and qwen.add_qkv_bias and not qwen.rotary_scaling
    assert qwen.vocab_size == (llama.vocab_size or 0) + 3  # same tokenizer, 3 spare rows: TP2 pads to even


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_type", "gpt2"),
        ("hidden_act", "gelu"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
        ("use_sliding_window", True),
    ],
)
def test_unsupported_field_names_it(models: dict[str, Path], field: str, value: Any) -> None:
    hf = json.loads((models["qwen2"] / "config.json").read_text())
    hf[field] = value
    with pytest.raises(HFConfigError, match=field.split("_parameters")[0]):
        arch_values(hf)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"pp": 2}], ids=["tp1", "tp2", "pp2"])
def test_import_matches_transformers(
    models: dict[str, Path], kind: str, layout: dict[str, int], tmp_path: Path
) -> None:
    toks = tokens(model_config(models[kind]).vocab_size or 0)
    want = hf_logits(models[kind], toks)
    spec = {
        "hf_dir": str(models[kind]),
        "parallel": layout,
        "tokens": toks,
        "logits": str(tmp_path / "l.npy"),
    }
    launch(layout.get("tp", 1) * layout.get("pp", 1), spec, tmp_path / "run", script=WORKER)
    got = np.load(tmp_path / "l.npy")
    assert got.shape == want.shape
    assert rel_diff(got, want) < REL, rel_diff(got, want)
