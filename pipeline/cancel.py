"""``python -m pipeline.cancel``: a run's queued and running jobs (pipeline.cli.cancel), or a search: its
controller and every trial in flight (pipeline.search.manage)."""

import sys
from pathlib import Path

from pipeline.cli.cancel import main as run_cancel
from pipeline.search.manage import cancel as search_cancel
from pipeline.search.study import is_sweep


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) == 1 and is_sweep(Path(args[0])):
        done = search_cancel(Path(args[0]).resolve())
        print(f"search cancelled: controller stopped; trials stopped: {done or 'none in flight'}")
        return 0
    return run_cancel(args)


if __name__ == "__main__":
    raise SystemExit(main())
