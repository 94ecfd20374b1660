"""lm-eval task results with the models side by side: in the table printed after a run and in the HTML report,
``value ± stderr`` per task metric, ``-`` where a model lacks one."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.reporting.html import eval_table
from pipeline.reporting.results import results_table, task_grid

MODELS = {
    "hf:/models/base": {
        "perplexity": 20.5,
        "lm_eval": {"arc_easy": {"metrics": {"acc": {"value": 0.25, "stderr": 0.02}}}},
    },
    "pretrain": {
        "perplexity": 12.25,
        "lm_eval": {
            "arc_easy": {"metrics": {"acc": {"value": 0.41, "stderr": 0.021}}},
            "gsm8k": {"metrics": {"exact_match,strict-match": {"value": 0.03, "stderr": None}}},
        },
    },
    "sft": {"perplexity": 11.0},
}


def write(tmp_path: Path) -> Path:
    path = tmp_path / "stages" / "eval" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"models": MODELS}))
    return path


def test_task_grid_puts_models_side_by_side() -> None:
    cols, rows = task_grid(MODELS)
    assert cols == ["arc_easy acc", "gsm8k exact_match,strict-match"]
    assert rows == [
        ["hf:/models/base", "0.2500 ± 0.0200", "-"],
        ["pretrain", "0.4100 ± 0.0210", "0.0300"],
        ["sft", "-", "-"],
    ]
    assert task_grid({"sft": {"perplexity": 1.0}}) == ([], [])


def test_printed_table_and_report_show_the_task_columns(tmp_path: Path) -> None:
    text = results_table(write(tmp_path))
    line = next(x for x in text.splitlines() if x.startswith("arc_easy acc"))
    assert line.split() == ["arc_easy", "acc", "0.2500", "±", "0.0200", "0.4100", "±", "0.0210", "-"]
    html = eval_table(tmp_path)
    grid = re.search(r'<table class="eval-tasks">(.*?)</table>', html, re.S)
    assert grid is not None and "<th>gsm8k exact_match,strict-match</th>" in grid.group(1)
    assert "<td>0.4100 ± 0.0210</td>" in grid.group(1)
    (tmp_path / "stages" / "eval" / "results.json").write_text(json.dumps({"models": {"sft": MODELS["sft"]}}))
    assert "eval-tasks" not in eval_table(tmp_path) and "lm-eval task" not in results_table(
        tmp_path / "stages" / "eval" / "results.json"
    )


def test_a_long_model_name_keeps_the_columns_aligned(tmp_path: Path) -> None:
    """A model named by a long ``hf:`` path is shortened in the middle; every line's columns start where the
    header's do (results.json keeps the full name)."""
    long = "hf:/lustre/fsx/shared/checkpoints/org-team/llama-3.1-8b-instruct-sft-v2"
    models = {long: MODELS["hf:/models/base"], "pretrain": MODELS["pretrain"]}
    path = write(tmp_path)
    path.write_text(json.dumps({"models": models}))
    text = results_table(path)
    lines = text.splitlines()
    head, _, shown, short = lines[:4]
    assert shown.startswith("hf:/lustr…") and shown.split()[0].endswith("/llama-3.1-8b-instruct-sft-v2")
    assert len(shown.split()[0]) == 40 and short.split()[0] == "pretrain"
    end = head.index("perplexity") + len("perplexity")
    assert shown[:end].endswith("20.50") and short[:end].endswith("12.25"), text
    grid = lines[lines.index("") + 1 :]  # the task lines: every cell right-aligned under its model's name
    assert all(len(row) == len(grid[0]) for row in grid), grid
    assert grid[0].endswith(" pretrain") and grid[1].endswith("0.4100 ± 0.0210"), grid
    assert "…" in grid[0] and grid[1].split("0.2500")[0].strip() == "arc_easy acc", grid
