"""The CUDA path: every test here needs a CUDA GPU and is skipped without one (never faked).

Run them all with ``make gpu-check`` (scripts/gpu-check.sh: carried wheels, these tests, the MFU benchmark,
one log). What they prove on one GPU:
- the tiny graph end to end through the local executor (data prep, pretrain, SFT, DPO, eval) on CUDA;
- bf16 (fp32 main gradients) and fp16 (dynamic loss scaling: overflows skipped and counted) steps learn;
- SDPA attention against megatron's unfused attention, same weights, same losses;
- checkpoint save/resume on CUDA is bit-exact (model, optimizer, next steps);
- a tiny Mixture of Experts (4 experts, top-2; Transformer Engine's grouped GEMM where TE is present) learns
  in bf16 and follows its fp32 losses;
- generation with RoPE and the KV cache (keys rotated once, when cached) gives the tokens of full recomputation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.timing import scaled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}


def train(tmp: Path, precision: str, iters: int, **model: Any) -> list[dict[str, Any]]:
    spec = {
        "model": {**TINY, **model},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8, "precision": precision},
        "stage": {"iters": iters, "threads": 4},
        "samples": 8,
    }
    return list(launch(1, spec, tmp, timeout_s=scaled(300))["history"])


@pytest.mark.timeout(900)
def test_tiny_graph_end_to_end_on_cuda_through_the_local_executor(tmp_path: Path) -> None:
    r = subprocess.run(
        # gpus_per_node: the local controller makes that many GPUs visible to the ranks (else none)
        [
            sys.executable,
            "-m",
            "pipeline",
            "experiment=tiny",
            "cluster.gpus_per_node=1",
            f"run.root={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(880),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for stage in ("data_prep", "pretrain", "sft", "rlhf", "eval"):
        assert json.loads((run_dir / "ledger" / f"{stage}.json").read_text())["status"] == "completed", stage
    results = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())
    assert set(results["models"]) == {"pretrain", "sft", "rlhf"}
    assert all(m["perplexity"] and m["perplexity"] > 1 for m in results["models"].values())
    print("\n" + r.stdout[-1500:])


@pytest.mark.timeout(600)
def test_bf16_steps_learn_on_cuda(tmp_path: Path) -> None:
    bf16 = train(tmp_path / "bf16", "bf16", 12)
    fp32 = train(tmp_path / "fp32", "fp32", 12)
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.3, [h["loss"] for h in bf16]
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    assert bf16[-1]["loss"] == pytest.approx(fp32[-1]["loss"], rel=5e-2)
    print(f"\nbf16 loss {bf16[0]['loss']:.4f} -> {bf16[-1]['loss']:.4f}; fp32 -> {fp32[-1]['loss']:.4f}")


@pytest.mark.timeout(600)
def test_moe_steps_learn_on_cuda(tmp_path: Path) -> None:
    moe = {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
    bf16 = train(tmp_path / "bf16", "bf16", 12, **moe)
    fp32 = train(tmp_path / "fp32", "fp32", 12, **moe)
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.3, [h["loss"] for h in bf16]
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    assert bf16[-1]["loss"] == pytest.approx(fp32[-1]["loss"], rel=5e-2)
    print(f"\nMoE bf16 loss {bf16[0]['loss']:.4f} -> {bf16[-1]['loss']:.4f}; fp32 -> {fp32[-1]['loss']:.4f}")


@pytest.mark.timeout(600)
def test_fp16_steps_skip_overflows_and_learn_on_cuda(tmp_path: Path) -> None:
    fp16 = train(tmp_path / "fp16", "fp16", 40)
    over = [h for h in fp16 if h["overflow"]]
    good = [h for h in fp16 if not h["overflow"]]
    assert over and len(good) >= 10, [h["loss_scale"] for h in fp16]
    assert fp16[-1]["overflow_steps"] == len(over)
    assert good[-1]["loss"] < good[0]["loss"] - 0.3, [h["loss"] for h in good]
    print(f"\nfp16: {len(over)} overflow steps, final loss scale {fp16[-1]['loss_scale']:g}")


@pytest.mark.timeout(600)
def test_generation_with_rope_cache_equals_recompute_on_cuda(tmp_path: Path) -> None:
    from tests.engine.models.test_generate import MODEL, WORKER, check, spec

    rope = {**MODEL, "position_embedding": "rope", "num_query_groups": 2, "init_method_std": 0.5}
    check(launch(1, spec(model=rope), tmp_path, script=WORKER))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sdpa_attention_equals_unfused_on_cuda(tmp_path: Path, precision: str) -> None:
    from pipeline.schema.config import ModelConfig

    if "attention_backend" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        pytest.skip("model.attention_backend (the SDPA module) is not in this checkout")
    sdpa = train(tmp_path / "sdpa", precision, 4, attention_backend="sdpa")
    unfused = train(tmp_path / "unfused", precision, 4, attention_backend="unfused")
    tol = 1e-4 if precision == "fp32" else 2e-2
    for a, b in zip(sdpa, unfused):
        assert a["loss"] == pytest.approx(b["loss"], rel=tol)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=max(tol, 1e-3) * 10)


@pytest.mark.timeout(900)
def test_checkpoint_resume_is_bit_exact_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.resume_drill import MODEL, assert_exact_resume, run_pair

    # Deterministic cuBLAS and kernels: an uninterrupted run and a resumed one must agree bit for bit.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    spec = {"model": MODEL, "parallel": {"global_batch_size": 8, "micro_batch_size": 4}}
    a, b, a_dump, b_dump = run_pair(tmp_path, 1, spec)
    assert_exact_resume(a, b, a_dump, b_dump, world=1)
