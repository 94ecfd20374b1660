#!/usr/bin/env bash
# The GPU path in one prepared run (make gpu-check). Built for one H200 lent without registry access:
# Python 3.12 with a CUDA torch, no megatron-core/hydra/omegaconf/submitit; those come from .gpu-wheels/
# (carried in the working tree, prepared beforehand by scripts/gpu-wheels.sh on a machine with a registry).
#
#   bash scripts/gpu-check.sh            # everything it prints also goes to $OUT/gpu-check.log
#
# Steps: 1. find a CUDA GPU (none: say so, run the gpu-marked tests so they report skipped, exit 0);
# 2. a venv (.gpu-venv, --system-site-packages: the image's torch stays) with the carried wheels, offline;
# 3. every pytest test marked gpu (tests/gpu/test_gpu.py: the tiny graph end to end on CUDA, bf16/fp16 steps,
# SDPA vs unfused attention, bit-exact resume, a tiny MoE in bf16 and fp32 (grouped GEMM where TE is present), RoPE generation with the KV cache vs recomputation; tests/bench/test_bench.py's GPU bench); 4. the MFU benchmark
# (python -m bench.bench_throughput --gpu-only: Llama 3.2 1B and 3B shapes, bf16, seq 4096 and 8192, tokens/s,
# TFLOP/s, MFU against 790 TFLOP/s, torch profiler summary). Budget: 8 minutes (GPU_CHECK_BUDGET_S).
# Exit status: 0 when every step passed (or no GPU), else the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-runs/gpu-check}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu-check.log"
: >"$LOG"
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
START=$(date +%s)
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
VENV=${GPU_VENV:-.gpu-venv}
failed=0
GPU_TESTS=$(grep -rl --include='test_*.py' 'mark\.gpu' tests | sort | tr '\n' ' ')  # every file with gpu-marked tests

say() { echo "gpu-check [$(($(date +%s) - START)) s]: $*"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

main() {
say "log: $LOG; $(date -u '+%Y-%m-%d %H:%M:%S UTC'); $(uname -n); $("$PY" --version 2>&1)"
say "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') $(git status --porcelain 2>/dev/null | wc -l) changed files"

# ---------------------------------------------------------------- 1. a GPU?
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "no CUDA GPU here (torch.cuda.is_available() is False, or no torch): every GPU test is skipped, nothing run on a GPU"
  # The project's CPU venv when there is one: the gpu-marked tests are collected and report skipped.
  TPY=$PY
  [ -x .venv/bin/python ] && TPY=.venv/bin/python
  if "$TPY" -c "import pytest, torch" 2>/dev/null; then
    "$TPY" -m pytest -m gpu -q -p no:cacheprovider -rs $GPU_TESTS
    rc=$?
    [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && { say "FAILED: collecting the gpu tests (pytest exit $rc)"; exit 1; }
  fi
  say "done: no GPU, 0 GPU tests run"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu-check: gpu: /'
"$PY" -c "import torch; print('gpu-check: torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"

# ---------------------------------------------------------------- 2. the carried wheels, offline
need="megatron.core hydra omegaconf submitit tokenizers psutil pytest pytest_timeout numpy yaml"
if "$PY" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" $need 2>/dev/null; then
  say "every module the project needs imports already: using $PY"
else
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    say "FAILED: no wheels in $WHEELS (prepare them with 'bash scripts/gpu-wheels.sh' where a registry is reachable)"
    exit 1
  fi
  target=()
  if [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"; then
    PY=$VENV/bin/python
  else  # no venv module in the image: a plain folder on PYTHONPATH instead
    say "no venv here: installing into $VENV/site on PYTHONPATH"
    target=(--target "$VENV/site")
    export PYTHONPATH="$PWD/$VENV/site"
  fi
  say "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $VENV (offline, no dependency resolution)"
  if ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps "${target[@]}" "$WHEELS"/*.whl; then
    say "FAILED: installing the carried wheels"
    exit 1
  fi
  if ! "$PY" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" $need; then
    say "FAILED: a module still does not import (above); add its wheel to scripts/gpu-wheels.sh"
    exit 1
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import megatron.core as m, torch; print('gpu-check: megatron-core', m.__version__)"
"$PY" -c "from engine.models.gpt import attention_impl; print('gpu-check: attention layer spec:', attention_impl())"

# ---------------------------------------------------------------- 3. the gpu tests
say "gpu tests (budget left $(left) s)"
t=$(($(left) - 180))
[ "$t" -lt 60 ] && t=60
timeout "$t" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs -s --durations=0 \
  --junitxml="$OUT_DIR/gpu-tests.xml" $GPU_TESTS
rc=$?
[ "$rc" -eq 0 ] && say "gpu tests: passed" || { say "FAILED: gpu tests (exit $rc)"; failed=$((failed + 1)); }

# ---------------------------------------------------------------- 4. MFU benchmark
t=$(left)
if [ "$t" -lt 60 ]; then
  say "FAILED: no time left for the benchmark ($t s)"
  failed=$((failed + 1))
else
  say "MFU benchmark (budget left $t s)"
  timeout "$((t - 10))" "$PY" -m bench.bench_throughput --gpu-only --json "$OUT_DIR/bench.json" --profile \
    --gpu-deadline-s "$((t - 30))"
  rc=$?
  [ "$rc" -eq 0 ] && say "benchmark: done" || { say "FAILED: benchmark (exit $rc)"; failed=$((failed + 1)); }
fi

say "done: $failed failed step(s); log $LOG"
exit "$failed"
}

# tee in a pipeline (not a process substitution): the log is complete when the script exits.
main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
