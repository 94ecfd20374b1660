"""Reports: the eval results table comparing stages, and ``python -m pipeline.report <run_dir>``.

``python -m pipeline.report <run_dir | sweep_dir> [-o FILE]`` writes one self-contained HTML page
(pipeline.html_report): per-stage curves, the eval table, the timeline of attempts, alarms, config and
provenance; for a folder of run directories (a sweep's ``run.root``), overlaid curves and the trials'
final metrics, best first. Default output: ``<dir>/report.html``. Exit 2 when the path is neither.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.splitlines()[0])
    p.add_argument(
        "path", type=Path, help="a run directory (runs/<name>-<hash>) or a folder of them (a sweep)"
    )
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="HTML file to write (default <path>/report.html)"
    )
    a = p.parse_args(argv)
    from pipeline.html_report import is_run_dir, trials, write_report

    if not a.path.is_dir() or not (is_run_dir(a.path) or trials(a.path)):
        from pipeline.cli import report
        from pipeline.config import ConfigError

        msg = f"path={str(a.path)!r}: not a run directory (no ledger/ inside) nor a folder of run directories"
        return report(ConfigError(msg))
    print(write_report(a.path, a.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
