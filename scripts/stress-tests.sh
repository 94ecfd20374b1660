#!/usr/bin/env bash
# Runs a pytest selection several times while a CPU hog (Debian's stress-ng, two busy workers) loads the
# machine, then prints a table: test id -> failures per run, with the first error line of each. A failure it
# finds is a race in the product or in the test: fix its cause (docs/testing.md), never rerun to green.
#   scripts/stress-tests.sh [pytest args ...] [runs]      e.g.  scripts/stress-tests.sh -m "slurm or dist or slow" 3
# The runs' JUnit files and logs go to runs/stress/<time>/. Exit status 1 when any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
runs=3
if [ ${#args[@]} -gt 0 ] && [[ "${args[-1]}" =~ ^[0-9]+$ ]]; then
  runs=${args[-1]}
  unset 'args[-1]'
fi
PY=.venv/bin/python
[ -x "$PY" ] || { echo "stress-tests: no .venv: run make lint (or make test) first"; exit 2; }
if ! command -v stress-ng >/dev/null 2>&1; then
  echo "stress-tests: installing stress-ng"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends stress-ng >/dev/null
fi
bash slurm/install.sh
bash scripts/install-test-deps.sh
out="runs/stress/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"

# the hog: two CPU workers in a session of their own, ended with the script however it ends
setsid stress-ng --cpu 2 --quiet >"$out/hog.log" 2>&1 &
hog=$!
trap 'kill -TERM -- "-$hog" 2>/dev/null || true; wait "$hog" 2>/dev/null || true' EXIT

for i in $(seq 1 "$runs"); do
  echo "stress-tests: run $i of $runs under the hog (log: $out/run$i.log)"
  start=$(date +%s)
  set +e
  "$PY" -m pytest -n 2 --dist loadgroup -p no:cacheprovider --junitxml="$out/run$i.xml" "${args[@]}" \
    >"$out/run$i.log" 2>&1
  rc=$?
  set -e
  echo "stress-tests: run $i ended with exit $rc after $(( $(date +%s) - start )) s"
  tail -1 "$out/run$i.log"
done

"$PY" - "$out" "$runs" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, runs = Path(sys.argv[1]), int(sys.argv[2])
failed: dict[str, list[str]] = {}
ran: dict[str, int] = {}
for i in range(1, runs + 1):
    path = out / f"run{i}.xml"
    if not path.is_file():
        failed.setdefault(f"(run {i}: no JUnit file; see run{i}.log)", []).append(f"run {i}")
        continue
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        ran[tid] = ran.get(tid, 0) + 1
        for bad in (*case.findall("failure"), *case.findall("error")):
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            failed.setdefault(tid, []).append(f"run {i}: {first[0][:160] if first else bad.tag}")
print(f"\n{len(ran)} tests, {runs} runs under stress-ng --cpu 2 ({out})")
print("| test | failures / runs | first error line of each |")
print("|---|---|---|")
for tid, errs in sorted(failed.items()):
    print(f"| {tid} | {len(errs)} / {runs} | {'<br>'.join(errs)} |")
if not failed:
    print("| (none) | 0 | |")
sys.exit(1 if failed else 0)
EOF
