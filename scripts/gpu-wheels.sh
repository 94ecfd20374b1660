#!/usr/bin/env bash
# Prepare .gpu-wheels/ (gitignored) on a machine with registry access, for scripts/gpu-check.sh on a GPU
# machine without it (Python 3.12, torch with CUDA, Triton and the usual ML packages already there; no
# megatron-core, hydra-core, omegaconf or submitit: ../shared/FIELD-NOTES.md).
#
#   bash scripts/gpu-wheels.sh [DEST]        # default DEST: .gpu-wheels ; prints the wheels and their size
#
# Wheels for CPython 3.12 / manylinux x86_64, no dependencies resolved (the list is the closure of what the
# project imports minus what the GPU image has). antlr4-python3-runtime (hydra's parser) exists only as an
# sdist: it is built here into a pure-Python wheel. Fails when the folder would exceed MAX_MIB (a device
# call carries at most 64 MiB of working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
MAX_MIB=${MAX_MIB:-50}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PIP=("$PY" -m pip --disable-pip-version-check -q)

# name==version pins: megatron-core 0.19.x is the line for Python 3.12 (0.16.1 is the newest for 3.11).
BINARY=(
  "megatron-core>=0.19.2,<0.20"
  "hydra-core==1.3.2"
  "omegaconf==2.3.0"
  "submitit==1.5.4"
  "cloudpickle>=3"
  "PyYAML>=6"
  "psutil>=5.9"
  "xxhash>=3.0"
  "zstandard>=0.22"
  "pytest>=8"
  "Pygments>=2.7"
  "pluggy>=1.5"
  "iniconfig>=2"
  "pytest-timeout>=2.3"
)
SDIST_ONLY=("antlr4-python3-runtime==4.9.3")

mkdir -p "$DEST"
echo "gpu-wheels: downloading ${#BINARY[@]} wheels for CPython 3.12 manylinux x86_64 into $DEST"
"${PIP[@]}" download -d "$DEST" --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "${BINARY[@]}"
echo "gpu-wheels: building ${SDIST_ONLY[*]} (sdist only on PyPI) into a pure-Python wheel"
"${PIP[@]}" wheel -w "$DEST" --no-deps "${SDIST_ONLY[@]}"
# Keep one wheel per distribution (a rerun after a version change must not carry both).
"$PY" - "$DEST" <<'EOF'
import re, sys
from pathlib import Path
best = {}
for w in sorted(Path(sys.argv[1]).glob("*.whl"), key=lambda p: p.stat().st_mtime):
    name = re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower()
    if name in best:
        best[name].unlink()
    best[name] = w
EOF
ls -l "$DEST"
size_kib=$(du -sk "$DEST" | cut -f1)
echo "gpu-wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB ($size_kib KiB) in $DEST"
if [ "$size_kib" -gt $((MAX_MIB * 1024)) ]; then
  echo "gpu-wheels: $DEST is over MAX_MIB=$MAX_MIB MiB: a device call carries at most 64 MiB" >&2
  exit 1
fi
