"""``python -m pipeline.docs``: regenerate docs/CONFIG.md from the schema (pipeline.cli.docs)."""

from pipeline.cli.docs import main

if __name__ == "__main__":
    raise SystemExit(main())
