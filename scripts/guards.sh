#!/usr/bin/env bash
# The checks that need no training, cheapest first, so a broken guard ends `make test` in minutes and names
# the file and line (docs/testing.md has the order).
#   guards.sh quick   needs only the checking tools (scripts/setup.sh --guards): ruff, format, layering
#                     contracts, the docs site (mkdocs --strict: broken links), code shape, docs and hidden
#                     channels (tests that read the source, no import of the product)
#   guards.sh full    needs the whole install: mypy, every guard test (pytest -m guard: layering, every
#                     shipped YAML composes and validates), the wheel check
#   guards.sh         both (`make lint`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
start=$(date +%s)

step() {
  local t0=$SECONDS
  echo "guards: $*"
  "$@" || { echo "guards: FAILED: $* (after $(( $(date +%s) - start )) s)"; exit 1; }
  echo "guards: ok in $(( SECONDS - t0 )) s"
}

quick() {
  step "$PY" -m ruff check .
  step "$PY" -m ruff format --check .
  step .venv/bin/lint-imports
  # no -q: quiet mkdocs drops its warnings before --strict counts them (a broken link passed)
  step env NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d .venv/site
  # --noconftest: the suite's conftest imports the product (a full install); these tests read files only
  step "$PY" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
    tests/test_code_shape.py tests/test_docs.py tests/test_hidden_channels.py
}

full() {
  step "$PY" -m mypy
  step "$PY" -m pytest -q -p no:cacheprovider -o addopts="--strict-markers" -n 2 -m guard
  step bash scripts/check_wheel.sh
}

case "${1:-all}" in
  quick) quick ;;
  full) full ;;
  all) quick; full ;;
  *) echo "usage: guards.sh [quick|full]"; exit 2 ;;
esac
echo "guards: ${1:-all} passed in $(( $(date +%s) - start )) s"
