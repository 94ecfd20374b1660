# The two commands of the README. Both do all set-up on a fresh machine.
.PHONY: demo test setup lint gpu-check gpu-wheels

PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

# The whole pipeline on the embedded default: local executor, tiny model, shipped data.
demo: setup
	$(PY) -m pipeline

# The guards first (scripts/guards.sh: everything that needs no training; the quick half before the full
# install, so a broken guard fails in about a minute on a fresh machine), then what the tests need (the SLURM
# cluster's packages, MPI, chromium, tmux, prometheus), then the rest of the suite.
# Two pytest workers: much of the suite waits on subprocesses and the SLURM queue; the SLURM tests share one worker.
test:
	@bash scripts/setup.sh --guards
	@bash scripts/guards.sh quick
	@bash scripts/setup.sh
	@bash scripts/guards.sh full
	@bash slurm/install.sh
	@bash scripts/install-test-deps.sh
	$(PY) -m pytest -n 2 --dist loadgroup -m "not guard" --junitxml=runs/ci/junit.xml

# Before every commit: the same guards (about 2 minutes on 2 cores once set up).
lint:
	@bash scripts/setup.sh --guards
	@bash scripts/guards.sh quick
	@bash scripts/setup.sh
	@bash scripts/guards.sh full

# The GPU path in one run (scripts/gpu-check.sh; log in $OUT or runs/gpu-check/). Without a GPU it says so and
# exits 0 with every GPU test skipped. gpu-wheels prepares .gpu-wheels/ for a GPU machine without a registry.
gpu-check:
	@bash scripts/gpu-check.sh

gpu-wheels: setup
	@bash scripts/gpu-wheels.sh
