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
    return "\n".join(lines)
