"""``python -m pipeline.export``: export a trained stage as a Hugging Face model (pipeline.cli.export)."""

from pipeline.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
