"""``python -m pipeline.cancel``: cancel a run's queued and running jobs (pipeline.cli.cancel)."""

from pipeline.cli.cancel import main

if __name__ == "__main__":
    raise SystemExit(main())
