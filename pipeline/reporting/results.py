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


NAME_WIDTH = 40
"""The widest model name the printed table shows; a longer one (a ``hf:`` path) keeps its start and, longer,
its end (the model's folder) around an ellipsis (results.json has the full name)."""


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """``name`` cut to ``width`` characters: its first quarter and the rest from its end."""
    if len(name) <= width:
        return name
    head = (width - 1) // 4
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


def _number(v: Any, fmt: str) -> str:
    if not isinstance(v, (int, float)):
        return "-"
    return fmt.format(v) if abs(v) < 1e6 else f"{v:.2e}"


def results_table(path: Path) -> str:
    """The comparison table of eval's results.json (schema: docs/ARCHITECTURE.md, 'Eval results'): a line per
    model, then (when lm-eval tasks ran) a line per task metric with the models side by side. Columns stay
    aligned whatever the names' lengths."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    models: dict[str, dict[str, Any]] = data.get("models", {})
    names = {name: short_name(name) for name in models}
    first = max([len("model"), *map(len, names.values())]) + 2
    header = f"{'model':<{first}}" + "".join(f"{label:>14}" for _, label, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for name, res in models.items():
        cells = "".join(f"{_number(res.get(key), fmt):>14}" for key, _, fmt in COLUMNS)
        lines.append(f"{names[name]:<{first}}" + cells)
    cols, rows = task_grid(models)
    if cols:  # one line per task metric, the models side by side
        width = max(len(c) for c in cols) + 2
        each = [max(len(names[row[0]]), *map(len, row[1:])) + 2 for row in rows]  # a model's column
        lines += [
            "",
            f"{'lm-eval task':<{width}}" + "".join(f"{names[r[0]]:>{w}}" for r, w in zip(rows, each)),
        ]
        lines += [
            f"{c:<{width}}" + "".join(f"{r[1 + j]:>{w}}" for r, w in zip(rows, each))
            for j, c in enumerate(cols)
        ]
    return "\n".join(lines)
