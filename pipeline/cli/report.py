"""``python -m pipeline.report <run_dir>``: a run's or a sweep's HTML report.

``python -m pipeline.report <run_dir | sweep_dir> [-o FILE]`` writes one self-contained HTML page
(pipeline.reporting.html): per-stage curves, the eval table, the timeline of attempts, alarms, config and
provenance; for a folder of run directories (a sweep's ``run.root``), overlaid curves and the trials'
final metrics, best first. Default output: ``<dir>/report.html``. Exit 2 when the path is neither.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.splitlines()[0])
    p.add_argument(
        "path", type=Path, help="a run directory (runs/<name>-<hash>) or a folder of them (a sweep)"
    )
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="HTML file to write (default <path>/report.html)"
    )
    a = p.parse_args(argv)
    from pipeline.reporting.html import is_run_dir, trials, write_report

    if not a.path.is_dir() or not (is_run_dir(a.path) or trials(a.path)):
        from pipeline.cli.compose import report
        from pipeline.schema.errors import ConfigError

        msg = f"path={str(a.path)!r}: not a run directory (no ledger/ inside) nor a folder of run directories"
        return report(ConfigError(msg))
    print(write_report(a.path, a.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
