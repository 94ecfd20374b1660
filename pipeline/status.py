"""``python -m pipeline.status``: a run's stages (pipeline.cli.status) or a search's study (pipeline.search.manage)."""

import sys
from pathlib import Path

from pipeline.cli.status import main as run_status
from pipeline.search.manage import status as search_status
from pipeline.search.study import is_sweep


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) == 1 and is_sweep(Path(args[0])):
        return search_status(Path(args[0]).resolve())
    return run_status(args)


if __name__ == "__main__":
    raise SystemExit(main())
