#!/usr/bin/env bash
# CI check of the installable package: build the wheel from the working tree, install it into a fresh
# virtual environment and run a dry run of the default graph through the console command, outside the
# checkout. The fresh environment reuses .venv's installed dependencies (torch 2.13.0 CPU included) through a
# path entry and installs with --no-index: nothing is downloaded, and a dependency the wheel declares but
# that is not installed fails the check. About 10 s here.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)

# 1. the wheel, built from a copy of the working tree (no stale build/ folder can leak into it)
mkdir -p "$tmp/src"
git ls-files -co --exclude-standard -z | sort -zu \
  | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done | xargs -0 cp --parents -t "$tmp/src"
isolation=()  # build with .venv's setuptools when it has one (no download); else pip's isolated build env
"$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 64)' 2>/dev/null \
  && isolation=(--no-build-isolation)
"$PY" -m pip --disable-pip-version-check -q wheel --no-deps "${isolation[@]}" -w "$tmp/dist" "$tmp/src"
wheel=$(ls "$tmp"/dist/llm_pipeline-*.whl)
unzip -l "$wheel" | grep -q "pipeline/conf/config.yaml" || { echo "check_wheel: conf/ missing from $wheel"; exit 1; }

# 2. a fresh venv that sees .venv's dependencies (as .venv does: the system's site-packages, plus .venv's\n#    own as a plain path entry, so .venv's editable install of this checkout stays off)
"$("$PY" -c 'import sys; print(sys._base_executable)')" -m venv --without-pip --system-site-packages "$tmp/venv"
site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/_ci_dependencies.pth"
"$PY" -m pip --disable-pip-version-check -q --python "$tmp/venv/bin/python" install --no-index \
  -c "$ROOT/.venv/constraints.txt" "$wheel" > "$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log"; exit 1; }

# 3. the console commands, from outside the checkout
cd "$tmp"
where=$("$tmp/venv/bin/python" -c 'import pipeline; print(pipeline.__file__)')
case "$where" in "$tmp/venv/"*) ;; *) echo "check_wheel: imported pipeline from $where, not the wheel"; exit 1 ;; esac
"$tmp/venv/bin/llm-pipeline" run.dry_run=true run.root="$tmp/runs" > "$tmp/dry.txt"
for s in data_prep pretrain sft rlhf eval; do
  grep -q "=== $s:" "$tmp/dry.txt" || { cat "$tmp/dry.txt"; echo "check_wheel: stage $s missing from the dry run"; exit 1; }
done
"$tmp/venv/bin/llm-pipeline-plan" experiment=tiny > /dev/null
"$tmp/venv/bin/llm-pipeline-status" --help > /dev/null
"$tmp/venv/bin/llm-pipeline-cancel" --help > /dev/null
COMP_LINE="llm-pipeline mod" "$tmp/venv/bin/llm-pipeline" -sc query=bash | grep -q "model=" \
  || { echo "check_wheel: Hydra tab completion of llm-pipeline gave no model= option"; exit 1; }
echo "check_wheel: wheel installs and runs (dry run of the default graph) in $(( $(date +%s) - start )) s"
