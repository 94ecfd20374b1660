"""A search's results on disk: best.yaml reproduces the best trial, the sweep report shows the history."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from pipeline.cli.compose import load
from pipeline.reporting.html import write_report
from pipeline.search import study as studies
from pipeline.search.space import parse


def test_best_yaml_and_history(tmp_path: Path) -> None:
    space = parse(["experiment=tiny", "search=optuna", "pretrain.lr=tag(log, interval(1e-4, 1e-2))"])
    cfg = load([*space.base, *space.search], inputs=False)
    study = optuna.create_study(direction="minimize")
    for lr, value, state in (
        (1e-3, 5.0, TrialState.COMPLETE),
        (2e-3, 4.5, TrialState.COMPLETE),
        (5e-3, None, None),
    ):
        pruned = state is None
        study.add_trial(
            optuna.trial.create_trial(
                params={"pretrain.lr": lr},
                distributions=space.dims,
                value=6.0 if pruned else value,
                state=TrialState.PRUNED if pruned else state,
                intermediate_values={2: 6.0},
                user_attrs={"pruned": {"step": 2, "value": 6.0}} if pruned else {"wall_s": 3.0},
            )
        )
    (tmp_path / ".search").mkdir()
    studies.write_summary(tmp_path, study, cfg, space)
    best = yaml.safe_load(studies.write_best(tmp_path, study, space).read_text())  # type: ignore[union-attr]
    assert best["trial"] == 1 and best["value"] == 4.5
    assert best["overrides"][-1] == f"pretrain.lr={best['params']['pretrain.lr']!r}"
    html = write_report(tmp_path).read_text()
    assert "Search: 3 of 16 trials (complete 2, pruned 1)" in html
    assert "optimisation history" in html and "best: trial 1" in html
    # parallel coordinates: lr and the objective for both completed trials, lr alone for the pruned one
    coords = re.search(
        r'<figure class="plot" data-points="(\d+)" data-title="parameters and [^"]*">.*?</figure>', html
    )
    assert coords and int(coords.group(1)) == 5, coords
    assert coords.group(0).count("<polyline") == 2  # the pruned trial's one value draws no line
    assert 'stroke="#d62728" stroke-width="2.4"' in coords.group(0)  # the best trial stands out


def test_importances_name_the_key_that_moves_the_objective(tmp_path: Path) -> None:
    space = parse(
        [
            "experiment=tiny",
            "search=optuna",
            "pretrain.lr=tag(log, interval(1e-4, 1e-2))",
            "pretrain.warmup_iters=range(0,3)",
        ]
    )
    cfg = load([*space.base, *space.search], inputs=False)
    study = optuna.create_study(direction="minimize")
    for i in range(12):
        lr, warmup = 10 ** (-4 + 2 * i / 11), i % 3
        study.add_trial(
            optuna.trial.create_trial(
                params={"pretrain.lr": lr, "pretrain.warmup_iters": warmup},
                distributions=space.dims,
                value=(math.log10(lr) + 2.5) ** 2 + 1e-3 * warmup,  # lr decides, warmup hardly
                state=TrialState.COMPLETE,
            )
        )
    (tmp_path / ".search").mkdir()
    studies.write_summary(tmp_path, study, cfg, space)
    imp = json.loads((tmp_path / ".search" / "study.json").read_text())["importances"]
    assert set(imp) == {"pretrain.lr", "pretrain.warmup_iters"} and imp["pretrain.lr"] > 0.8, imp
    html = write_report(tmp_path).read_text()
    assert "Parameter importances (fANOVA)" in html
    assert html.index("pretrain.lr</td>") < html.index("pretrain.warmup_iters</td>")  # largest first
