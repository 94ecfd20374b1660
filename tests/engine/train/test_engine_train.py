"""The training engine end to end on a tiny GPT: every run is a fresh subprocess (tests/support/engine_worker.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_worker import launch

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": dict(TINY),
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
        "stage": {"iters": 2},
        "samples": 8,
    }
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(base.get(k), dict) else v
    return base


def losses(result: dict[str, Any]) -> list[float]:
    return [h["loss"] for h in result["history"]]


@pytest.mark.timeout(600)
def test_pretrain_step_writes_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    r = launch(1, spec(metrics=str(metrics)), tmp_path)
    assert r["summary"]["steps"] == 2 and math.isfinite(r["summary"]["final_loss"])
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    valid = [x for x in lines if x["kind"] == "valid"]
    assert [x["step"] for x in train] == [1, 2]
    for key in ("iters", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "eta_s", "time"):
        assert key in train[0], key
    assert train[-1]["eta_s"] == 0
    assert valid and valid[-1]["step"] == 2 and valid[-1]["ppl"] == pytest.approx(math.exp(valid[-1]["loss"]))


@pytest.mark.timeout(600)
def test_sft_step(tmp_path: Path) -> None:
    r = launch(1, spec(step="sft"), tmp_path)
    assert all(math.isfinite(x) for x in losses(r))


@pytest.mark.timeout(600)
def test_dpo_step_starts_at_log2_and_learns(tmp_path: Path) -> None:
    r = launch(1, spec(step="dpo", stage={"iters": 3}), tmp_path)
    first, last = r["history"][0], r["history"][-1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 0
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert last["loss"] < first["loss"] and last["reward_margin"] > 0 and last["pref_acc"] > 0.5


@pytest.mark.timeout(600)
def test_loss_decreases_on_repeated_batch(tmp_path: Path) -> None:
    r = launch(1, spec(stage={"iters": 6, "lr": 3e-3, "min_lr": 3e-3}), tmp_path)
    seen = losses(r)
    assert all(b < a for a, b in zip(seen, seen[1:])), seen
    assert seen[-1] < seen[0] - 0.3, seen


# ---------------------------------------------------------------------------- layouts agree with one rank


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One-rank reference run; also saves its initial weights for layouts that build them differently."""
    tmp = tmp_path_factory.mktemp("single")
    weights = tmp / "weights"
    return launch(1, spec(save_weights=str(weights)), tmp), weights


def _assert_same_losses(got: dict[str, Any], want: dict[str, Any]) -> None:
    for a, b in zip(losses(got), losses(want), strict=True):
        assert a == pytest.approx(b, rel=1e-5), (losses(got), losses(want))


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_data_parallel_2_matches_single_rank(single_rank: tuple[dict, Path], tmp_path: Path) -> None:
    _assert_same_losses(launch(2, spec(), tmp_path), single_rank[0])


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_tensor_parallel_2_matches_single_rank(single_rank: tuple[dict, Path], tmp_path: Path) -> None:
    _assert_same_losses(launch(2, spec(parallel={"tp": 2}), tmp_path), single_rank[0])


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_pipeline_parallel_2_matches_single_rank(single_rank: tuple[dict, Path], tmp_path: Path) -> None:
    # stage 1 initialises its layers from another generator state: start from the saved weights
    r = launch(2, spec(parallel={"pp": 2}, load_weights=str(single_rank[1])), tmp_path)
    _assert_same_losses(r, single_rank[0])


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_interleaved_pipeline_learns(tmp_path: Path) -> None:
    over = {"model": {"num_layers": 4}, "parallel": {"pp": 2, "vpp": 2}, "stage": {"iters": 4, "lr": 3e-3}}
    seen = losses(launch(2, spec(**over), tmp_path))
    assert seen[-1] < seen[0] - 0.2, seen
