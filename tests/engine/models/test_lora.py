"""LoRA (``<stage>.peft.method=lora``, engine/models/lora.py): config validation, frozen base, adapters-only
checkpoints, exact resume, merged weights, TP2 == TP1.

The engine runs are fresh process groups in subprocesses (tests/support/resume_drill.py for the resume drill,
tests/support/engine_worker.py for the layouts).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from pipeline.cli.plan import compose_config  # noqa: E402
from pipeline.schema.errors import ConfigError  # noqa: E402
from pipeline.schema.stage_sections import PeftConfig  # noqa: E402
from tests.support import resume_drill as drill
from tests.support.engine_worker import launch as engine_launch
from tests.support.env import REPO
from tests.support.timing import scaled

LORA = {"method": "lora", "rank": 4, "alpha": 8.0}
SWIGLU = {**drill.MODEL, "activation": "swiglu", "normalization": "RMSNorm", "add_bias_linear": False}


# ---------------------------------------------------------------------------- config


def test_peft_config_validates_and_names_the_key() -> None:
    assert PeftConfig().method == "none"
    cfg = compose_config(["sft.peft.method=lora", "sft.peft.rank=4", "rlhf.peft.method=lora"])
    assert cfg.sft.peft.rank == 4 and cfg.rlhf.peft.target_modules[0] == "linear_qkv"
    cases = {
        "sft.peft.target_modules=[linear_qkv,linear_qvk]": "linear_fc2",  # the valid ones are listed
        "sft.peft.rank=0": "sft.peft.rank=0",
        "sft.peft.method=qlora": "sft.peft.method='qlora'",
        "sft.peft.dropout=1.0": "sft.peft.dropout",
        "pretrain.peft.method=lora": "pretrain.peft.method",
    }
    for override, needle in cases.items():
        with pytest.raises(ConfigError) as e:
            compose_config([override])
        assert needle in str(e.value), (override, str(e.value))
    with pytest.raises(ConfigError, match=r"sft.peft.method='lora'.*init_from"):
        compose_config(["sft.peft.method=lora", "sft.init_from=null"])


# ---------------------------------------------------------------------------- engine


def test_lora_checkpoint_holds_adapters_only_resumes_exactly_and_merges(tmp_path: Path) -> None:
    """Base frozen (no grads, not in the optimizer); the checkpoint holds adapters + their optimizer state and
    records its base; a resume after losing the last checkpoint is bit-exact; as init_from it loads merged."""
    import torch

    from engine.checkpoint.load import load_tensors

    base = tmp_path / "base" / "checkpoints"
    par = {"global_batch_size": 8, "micro_batch_size": 4}
    drill.launch(
        1,
        {
            "model": SWIGLU,
            "parallel": par,
            "root": str(base),
            "dump": str(tmp_path / "d0"),
            "base_only": True,
        },
        tmp_path / "base",
    )
    spec = {"model": SWIGLU, "parallel": par, "peft": LORA, "init_from": str(base)}
    a, b, a_dump, b_dump = drill.run_pair(tmp_path, 1, spec)
    drill.assert_exact_resume(a, b, a_dump, b_dump, world=1)
    assert a["frozen"] > 0 and a["frozen_with_grads"] == 0
    assert a["optimized"] == 8 * SWIGLU["num_layers"]  # A and B of qkv, proj, fc1, fc2 per layer

    final = tmp_path / "a" / "checkpoints" / "iter_0000004"
    tensors = load_tensors(final)
    model_keys = [k for k in tensors if not k.startswith("optimizer")]
    assert model_keys and all(k.endswith((".lora_a", ".lora_b")) for k in model_keys), model_keys[:5]
    assert len(model_keys) == 8  # A and B of 4 linears (megatron stacks the layers)
    assert any(k.startswith("optimizer") for k in tensors)
    from engine.models.lora import checkpoint_record

    rec = checkpoint_record(final)
    assert rec is not None and rec["rank"] == LORA["rank"] and Path(rec["base"]).parent == base
    assert tensors["decoder.layers.mlp.linear_fc1.lora_b"].shape[0] == SWIGLU["num_layers"]

    # the base weights never moved; the adapters did
    start, end = torch.load(b_dump / "loaded.rank0.pt"), torch.load(a_dump / "save4.rank0.pt")
    base_names = [k for k in end if k.startswith("model0.") and not k.endswith((".lora_a", ".lora_b"))]
    assert base_names and all(torch.equal(start[k], end[k]) for k in base_names)
    assert any(not torch.equal(start[k], end[k]) for k in end if k.endswith(".lora_b"))

    # init_from = the LoRA checkpoint, into a plain model: base + scale * B @ A
    c_dump = tmp_path / "c" / "dump"
    c_spec = {
        "model": SWIGLU,
        "parallel": par,
        "root": str(tmp_path / "c" / "checkpoints"),
        "dump": str(c_dump),
    }
    drill.launch(1, {**c_spec, "init_from": str(final.parent)}, tmp_path / "c")
    merged = torch.load(c_dump / "loaded.rank0.pt")
    scale = LORA["alpha"] / LORA["rank"]
    for layer in range(SWIGLU["num_layers"]):
        for lin in (
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            "mlp.linear_fc1",
            "mlp.linear_fc2",
        ):
            key = f"model0.decoder.layers.{layer}.{lin}"
            want = end[f"{key}.weight"] + scale * end[f"{key}.lora_b"] @ end[f"{key}.lora_a"]
            torch.testing.assert_close(merged[f"{key}.weight"], want, rtol=1e-6, atol=1e-7)


MODEL_TP = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "seq_length": 32,
}


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_lora_tp2_matches_tp1(tmp_path: Path) -> None:
    """Same initial adapters at any layout, and the same losses under TP=2 as TP=1 (fp32 tolerance of
    tests/engine/train/test_parallel.py), for swiglu (B of fc1 split into gate/up halves) and GQA."""
    from tests.support.metrics import FP32_REL, max_rel_delta

    model = {**MODEL_TP, "activation": "swiglu", "normalization": "RMSNorm", "add_bias_linear": False}
    spec = {
        "model": model,
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
        "stage": {"iters": 4, "lr": 1e-2, "min_lr": 1e-3},
        "samples": 8,  # one repeated batch: the loss must fall
        "peft": {**LORA, "alpha": 16.0},
    }
    one = engine_launch(1, spec, tmp_path / "tp1")
    two = engine_launch(2, {**spec, "parallel": {**spec["parallel"], "tp": 2}}, tmp_path / "tp2")
    got, want = [h["loss"] for h in two["history"]], [h["loss"] for h in one["history"]]
    delta = max_rel_delta(got, want)
    print(
        f"LoRA tp2 vs tp1: max relative loss delta over 4 steps = {delta:.2e}; trainable {one['trainable_rank0']}"
    )
    assert delta < FP32_REL, (got, want)
    assert want[-1] < want[0]  # the adapters learn
    assert one["trainable_rank0"] < one["params_rank0"] / 5
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_planner_counts_the_adapters_the_engine_trains() -> None:
    """The planner's LoRA parameter count equals the engine's (9,728 trainable in test_lora_tp2_matches_tp1);
    gradients and optimizer state cover the adapters only, and the checkpoint holds only them."""
    from pipeline.schema.config import ModelConfig
    from pipeline.schema.estimates import estimate_stage
    from pipeline.schema.params import lora_layer_params

    model = ModelConfig(
        **{**MODEL_TP, "activation": "swiglu", "normalization": "RMSNorm", "add_bias_linear": False}
    )
    assert model.num_layers * lora_layer_params(model, 4, list(PeftConfig().target_modules)) == 9728
    assert lora_layer_params(model, 4, ["linear_qkv"], tp=2) == 4 * 64 + 128 * 4 // 2
    full = estimate_stage(compose_config(["run.stages=[sft]"]), "sft")
    lora = estimate_stage(compose_config(["run.stages=[sft]", "sft.peft.method=lora"]), "sft")
    f, r = full.ranks[0], lora.ranks[0]
    assert r.trainable and r.trainable < f.params / 10
    assert r.optimizer * f.params == f.optimizer * r.trainable and r.weights > f.weights
    assert lora.checkpoint is not None and full.checkpoint is not None
    assert lora.checkpoint.total_bytes < full.checkpoint.total_bytes / 10
    assert "trainable (LoRA adapters)" in subprocess_plan(["run.stages=[sft]", "sft.peft.method=lora"])


def subprocess_plan(overrides: list[str]) -> str:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "pipeline.plan", *overrides],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


EXPORT_BOTH = """
import json, sys
from pathlib import Path
from engine.checkpoint.latest import find_latest
from engine.convert.hf_export import export
from engine.convert.peft_export import export_peft
from pipeline.schema.hf_arch import model_config
hf, root, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
model, ckpt = model_config(hf, seq_length=32), find_latest(root, collective=False)
merged = export(model, ckpt, out / "merged", hf)
peft = export_peft(model, ckpt, out / "peft", hf)
print(json.dumps({"merged": merged["check"], "peft": peft["check"]}))
"""

LOGITS = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
hf, out = sys.argv[1], sys.argv[2]
tokens = torch.tensor([[5, 17, 99, 3, 250, 7, 41, 12], [1, 2, 3, 4, 5, 6, 7, 8]])
load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
with torch.no_grad():
    base = load(hf)(tokens).logits
    merged = load(out + "/merged")(tokens).logits
    peft = PeftModel.from_pretrained(load(hf), out + "/peft").eval()(tokens).logits
rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
print(rel(peft, merged), rel(base, merged))
"""


def test_lora_export_merged_and_peft_give_the_same_logits(tmp_path: Path) -> None:
    """SFT-style LoRA from a Hugging Face Llama-3-style model, then both exports: the merged model and the
    PEFT adapter directory loaded by ``peft`` onto the base give the same logits (and not the base's)."""
    import dataclasses
    import json
    import subprocess

    from pipeline.schema.hf_arch import model_config
    from tests.support.hf_models import make

    hf = make("llama3", tmp_path / "hf")
    model = dataclasses.asdict(model_config(hf, seq_length=32))
    root = tmp_path / "run" / "checkpoints"
    spec = {"model": model, "parallel": {"global_batch_size": 8, "micro_batch_size": 4}, "peft": LORA}
    drill.launch(
        1, {**spec, "init_from": str(hf), "root": str(root), "dump": str(tmp_path / "dump")}, tmp_path / "run"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-c"]
    done = subprocess.run(
        [*run, EXPORT_BOTH, str(hf), str(root), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(600),
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    assert checks["merged"]["passed"] and checks["peft"]["passed"], checks
    adapter = json.loads((tmp_path / "out" / "peft" / "adapter_config.json").read_text())
    assert adapter["r"] == LORA["rank"] and set(adapter["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    done = subprocess.run(
        [*run, LOGITS, str(hf), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peft_vs_merged, base_vs_merged = map(float, done.stdout.split())
    print(f"\nLoRA export: peft vs merged {peft_vs_merged:.2e}, base vs merged {base_vs_merged:.2e}")
    assert peft_vs_merged < 1e-5 and base_vs_merged > 100 * peft_vs_merged
