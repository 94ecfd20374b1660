"""``python -m pipeline.search <sweep_dir>``: the search controller (started detached by ``python -m pipeline -m search=optuna``)."""

from pipeline.search.controller import main

if __name__ == "__main__":
    raise SystemExit(main())
