"""``experiment=moe-tiny`` (a tiny Mixture of Experts of its own) through the real command line: the whole
default graph on the local executor at EP1, pretraining again at EP2 (``pretrain.parallel.ep=2``, 2 ranks)
with the same losses; the MoE metrics reach metrics.jsonl, TensorBoard and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.schema.graph import DEFAULT_STAGES
from tests.support.cli import metrics, ok, run, run_dir, seeded
from tests.support.metrics import FP32_REL, max_rel_delta, tb_scalars
from tests.support.timing import scaled

MOE_KEYS = (
    "moe_aux_loss",
    "moe_z_loss",
    "moe_layer0_tokens_max",
    "moe_layer1_tokens_entropy",
    "moe_dropped_frac",
)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_moe_tiny_whole_graph_at_ep1_then_pretrain_at_ep2(tmp_path: Path) -> None:
    one = tmp_path / "ep1"
    r = run(one, "experiment=moe-tiny", timeout=scaled(900))
    ok(r)
    d = run_dir(one)
    for stage in DEFAULT_STAGES:
        assert json.loads((d / "ledger" / f"{stage}.json").read_text())["status"] == "completed", stage
    lines = metrics(one, "train")
    assert all(k in lines[-1] for k in MOE_KEYS), sorted(lines[-1])
    assert 0.25 <= lines[-1]["moe_layer0_tokens_max"] <= 1 and lines[-1]["moe_dropped_frac"] == 0
    tags = tb_scalars(d / "stages" / "pretrain" / "tensorboard")
    assert {"train/moe_aux_loss", "train/moe_layer1_tokens_max"} <= set(tags), sorted(tags)
    report = (d / "report.html").read_text()
    assert "pretrain: load-balancing loss" in report and "sft: routing entropy" in report

    two = seeded(one, tmp_path / "ep2")
    r2 = run(
        two,
        "experiment=moe-tiny",
        "pretrain.parallel.ep=2",
        "run.stages=[data_prep,pretrain]",
        timeout=scaled(900),
    )
    ok(r2)
    assert "skipped" in r2.stdout  # data_prep, from the seed
    lines2 = metrics(two, "train")
    for key in ("loss", "moe_aux_loss", "moe_layer0_tokens_max"):
        got, want = [x[key] for x in lines2], [x[key] for x in lines]
        assert max_rel_delta(got, want) < FP32_REL, (key, got, want)
