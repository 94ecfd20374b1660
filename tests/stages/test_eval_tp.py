"""Eval on a tensor-parallel or a pipeline-parallel layout gives the same numbers as on one rank (same
checkpoints, same data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine_worker import launch
from tests.support.env import REPO
from tests.support.timing import scaled

WORKER = REPO / "tests" / "support" / "eval_worker.py"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eval_tp2_and_pp2_equal_one_rank(tmp_path: Path) -> None:
    base = ["experiment=tiny", f"run.root={tmp_path}", "eval.models=[pretrain,sft]"]
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", *base, "cluster=debug", "run.stages=[data_prep,pretrain,sft]"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(900),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = next(tmp_path.glob("tiny-*"))
    res = {}
    for name, ranks, key in (("one", 1, "tp=1"), ("tp2", 2, "tp=2"), ("pp2", 2, "pp=2")):
        spec = {
            "overrides": [*base, f"eval.parallel.{key}"],
            "run_dir": str(run_dir),
            "out_dir": str(tmp_path / f"eval-{name}"),
        }
        res[name] = launch(ranks, spec, tmp_path / f"w-{name}", script=WORKER)
    one = res["one"]["models"]
    for layout in ("tp2", "pp2"):
        two = res[layout]["models"]
        assert set(one) == set(two) == {"pretrain", "sft"}
        for m in one:
            assert two[m]["valid_loss"] == pytest.approx(one[m]["valid_loss"], rel=1e-5), layout
            assert two[m]["pref_margin"] == pytest.approx(one[m]["pref_margin"], rel=1e-4, abs=1e-4), layout
            for k in ("task_correct", "pref_accuracy"):
                assert two[m][k] == one[m][k], (layout, m, k)
            generated = [s["generated"] for s in two[m]["samples"]]
            assert generated == [s["generated"] for s in one[m]["samples"]], layout
