# The two commands of the README. Both do all set-up on a fresh machine.
.PHONY: demo test setup lint gpu-check gpu-wheels

PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

# The whole pipeline on the embedded default: local executor, tiny model, shipped data.
demo: setup
	$(PY) -m pipeline

# Everything the tests need (the SLURM cluster's packages, MPI, chromium, tmux), then the whole suite with lint and types.
# Two pytest workers: much of the suite waits on subprocesses and the SLURM queue; the SLURM tests share one worker.
test: setup
	@bash slurm/install.sh
	@bash scripts/install-test-deps.sh
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	.venv/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d .venv/site
	bash scripts/check_wheel.sh
	$(PY) -m pytest -n 2 --dist loadgroup

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy && .venv/bin/lint-imports

# The GPU path in one run (scripts/gpu-check.sh; log in $OUT or runs/gpu-check/). Without a GPU it says so and
# exits 0 with every GPU test skipped. gpu-wheels prepares .gpu-wheels/ for a GPU machine without a registry.
gpu-check:
	@bash scripts/gpu-check.sh

gpu-wheels: setup
	@bash scripts/gpu-wheels.sh
