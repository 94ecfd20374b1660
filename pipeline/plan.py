"""``python -m pipeline.plan``: the planner: per stage layout, memory and time estimates, suggestions (pipeline.cli.plan)."""

from pipeline.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
