# The two commands of the README. Both do all set-up on a fresh machine.
.PHONY: demo test setup lint

PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

# The whole pipeline on the embedded default: local executor, tiny model, shipped data.
demo: setup
	$(PY) -m pipeline

# Everything the tests need (the SLURM cluster's packages, MPI), then the whole suite with lint and types.
test: setup
	@bash slurm/install.sh
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	.venv/bin/lint-imports
	bash scripts/check_wheel.sh
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy && .venv/bin/lint-imports
