"""The eval results table comparing stages (printed after a run and by the report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (
    ("perplexity", "perplexity", "{:.2f}"),
    ("task_accuracy", "task acc", "{:.3f}"),
    ("pref_accuracy", "pref acc", "{:.3f}"),
)


def task_grid(models: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """lm-eval's task metrics with the models side by side: the columns ``<task> <metric>`` (every one any model
    has, in first-seen order) and per model its cells, ``value ± stderr`` (``-`` where it has none)."""
    columns: dict[str, None] = {}
    cells: dict[str, dict[str, str]] = {}
    for name, res in models.items():
        own = cells.setdefault(name, {})
        for task, sec in (res.get("lm_eval") or {}).items():
            for metric, m in sec.get("metrics", {}).items():
                col = f"{task} {metric}"
                columns[col] = None
                own[col] = _value_stderr(m.get("value"), m.get("stderr"))
    cols = list(columns)
    return cols, [[name, *(cells[name].get(c, "-") for c in cols)] for name in models if cols]


def _value_stderr(value: Any, stderr: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")


def results_table(path: Path) -> str:
    """The comparison table of eval's results.json (schema: docs/ARCHITECTURE.md, 'Eval results')."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    models: dict[str, dict[str, Any]] = data.get("models", {})
    header = f"{'model':<10}" + "".join(f"{label:>14}" for _, label, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for name, res in models.items():
        cells = []
        for key, _, fmt in COLUMNS:
            v = res.get(key)
            text = (
                fmt.format(v)
                if isinstance(v, (int, float)) and abs(v) < 1e6
                else f"{v:.2e}"
                if isinstance(v, (int, float))
                else "-"
            )
            cells.append(f"{text:>14}")
        lines.append(f"{name:<10}" + "".join(cells))
    cols, rows = task_grid(models)
    if cols:  # one line per task metric, the models side by side
        width = max(len(c) for c in cols) + 2
        lines += ["", f"{'lm-eval task':<{width}}" + "".join(f"{row[0]:>22}" for row in rows)]
        lines += [f"{c:<{width}}" + "".join(f"{row[1 + j]:>22}" for row in rows) for j, c in enumerate(cols)]
    return "\n".join(lines)
