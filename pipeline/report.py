"""``python -m pipeline.report``: write a run's (or a sweep's) HTML report (pipeline.cli.report)."""

from pipeline.cli.report import main

if __name__ == "__main__":
    raise SystemExit(main())
