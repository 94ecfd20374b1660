"""``python -m pipeline.status``: each stage's state from the ledger and the scheduler (pipeline.cli.status)."""

from pipeline.cli.status import main

if __name__ == "__main__":
    raise SystemExit(main())
