"""``python -m pipeline.status <run_dir>``: each stage's state from the ledger and the scheduler.

Shows pending / running / completed / failed / requeued (with count), where the logs are, and why a stage
failed (or which upstream failure keeps it from running).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.cli.compose import not_a_run_dir, stopped_on_ctrl_c
from pipeline.records.ledger import CANCELLED, FAILED
from pipeline.reporting.status import ACTIVE_VIEW, BLOCKED, format_status, live_lines, run_status
from pipeline.submit.interrupt import CtrlC, ctrl_c_raises


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.status", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a run directory (runs/<name>-<hash>)")
    p.add_argument("--watch", type=float, default=0, help="refresh every N seconds until nothing is active")
    a = p.parse_args(argv)
    if not (a.run_dir / "ledger").is_dir():
        return not_a_run_dir(a.run_dir)
    live = bool(a.watch) and sys.stdout.isatty()
    try:
        with ctrl_c_raises():
            while True:
                views = run_status(a.run_dir)
                text = format_status(a.run_dir, views)
                if a.watch:
                    text += "\n" + live_lines(a.run_dir, views, a.watch)
                # a terminal: redraw in place (cursor home, clear screen); a pipe: one block per refresh
                print(("\x1b[H\x1b[2J" if live else "") + text, flush=True)
                if not a.watch or not any(v.state in ACTIVE_VIEW for v in views):
                    return 1 if any(v.state in (FAILED, BLOCKED, CANCELLED) for v in views) else 0
                time.sleep(a.watch)
    except CtrlC:  # only the watching stops: the run's jobs go on
        return stopped_on_ctrl_c("status", "the run goes on; --watch again to follow it")


if __name__ == "__main__":
    raise SystemExit(main())
