"""Reward model: Bradley–Terry loss and accuracy by hand, training on separable pairs through the engine's one
loop (RewardStep), the frozen RewardModel callable for RL, init from a plain GPT checkpoint (head fresh), and
the same scores at TP=2 as at TP=1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.timing import scaled

WORKER = REPO / "tests" / "support" / "reward_worker.py"


def test_bradley_terry_by_hand() -> None:
    from engine.models.reward import bradley_terry
    from engine.train.steps import RewardStep

    rewards = torch.tensor([[2.0, 0.0], [0.5, 1.5], [1.0, 1.0]])
    loss, correct, margin = bradley_terry(rewards)
    expected = -sum(math.log(1 / (1 + math.exp(-m))) for m in (2.0, -1.0, 0.0))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert correct.item() == 1.0 and margin.item() == pytest.approx(1.0)
    total, pairs, metrics = RewardStep.loss(rewards.reshape(-1))  # the step's output: [2b] chosen, rejected
    assert pairs.item() == 3 and total.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"].tolist() == [1.0, 3.0]


def test_separable_pairs_reach_zero_loss_and_full_accuracy() -> None:
    from engine.models.reward import bradley_terry

    r = torch.zeros(8, 2, requires_grad=True)
    opt = torch.optim.SGD([r], lr=1.0)
    for _ in range(50):
        opt.zero_grad()
        loss, correct, _ = bradley_terry(r)
        loss.backward()
        opt.step()
    assert correct.item() == 8 and loss.item() / 8 < 0.05


def test_last_index_reads_the_last_trained_label() -> None:
    from engine.models.reward import last_index

    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    assert last_index(mask).tolist() == [2, 4, 0]


@pytest.mark.timeout(600)
def test_reward_model_learns_separable_pairs_and_scores_held_out(tmp_path: Path) -> None:
    spec = {"iters": 30, "ckpt": str(tmp_path / "ckpt"), "init": str(tmp_path / "sft")}
    res = launch(1, spec, tmp_path / "w", script=WORKER)
    hist = res["history"]
    assert res["init_loaded"]
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"], hist
    assert hist[-1]["accuracy"] == 1.0, hist[-1]
    assert res["dtype"] == "float32" and len(res["scores"]) == 48
    assert res["held_out_accuracy"] == 1.0


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_reward_model_tp2_equals_tp1(tmp_path: Path) -> None:
    one = launch(1, {"iters": 3, "ckpt": str(tmp_path / "c1")}, tmp_path / "tp1", script=WORKER)
    two = launch(
        2, {"iters": 3, "ckpt": str(tmp_path / "c2"), "parallel": {"tp": 2}}, tmp_path / "tp2", script=WORKER
    )
    for a, b in zip(one["history"], two["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert one["scores"] == pytest.approx(two["scores"], rel=1e-4, abs=1e-5)


LLAMA = (
    "model.normalization=RMSNorm",
    "model.activation=swiglu",
    "model.position_embedding=rope",
    "model.add_bias_linear=false",
    "model.vocab_size=512",  # export needs it set (the tiny tokenizer has 512)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_reward_model_and_export_stages_through_the_cli(tmp_path: Path) -> None:
    """The opt-in stages in the graph: reward_model (from SFT, eval scores it on the held-out pairs), GRPO
    rewarded by verifier + reward model (rlhf.reward=both), and export (the last step: a verified Hugging
    Face directory of the rlhf model, recorded in the ledger)."""
    import json

    from pipeline.records.ledger import Ledger
    from tests.support.cli import run_pipeline

    stages = "[data_prep,pretrain,sft,reward_model,rlhf,eval,export]"
    r = run_pipeline(
        "experiment=tiny",
        "cluster=debug",
        f"run.root={tmp_path}",
        f"run.stages={stages}",
        "eval.models=[sft]",
        "rlhf=grpo",
        "rlhf.reward=both",
        *LLAMA,
        timeout=scaled(1100),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = next(Path(tmp_path).glob("tiny-*"))
    ledger = Ledger(run_dir)
    rm = ledger.read("reward_model")
    assert rm and rm.status == "completed" and rm.outputs["init_from"].endswith("sft/checkpoints")
    lines = [json.loads(x) for x in (run_dir / "stages/reward_model/metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert train and {"loss", "accuracy", "margin"} <= set(train[-1])
    assert any(x["kind"] == "valid" and "accuracy" in x for x in lines)
    results = json.loads((run_dir / "stages/eval/results.json").read_text())
    assert 0.0 <= results["reward_model"]["pref_accuracy"] <= 1.0 and results["reward_model"]["pairs"] > 0
    assert "reward_model" in r.stdout  # the eval table's row
    rl = [json.loads(x) for x in (run_dir / "stages/rlhf/metrics.jsonl").read_text().splitlines()]
    assert any(x["kind"] == "train" and "reward_mean" in x for x in rl)
    exp = ledger.read("export")
    assert exp and exp.status == "completed" and exp.outputs["stage"] == "rlhf"
    assert exp.outputs["check"]["passed"] is True
    assert (Path(exp.outputs["out"]) / "config.json").is_file()
    assert ledger.read("rlhf").extra["export"]["passed"] is True  # recorded on the exported stage too
