#!/usr/bin/env bash
# System packages the test suite needs besides SLURM (slurm/install.sh): Debian's chromium (the HTML report
# is checked in a real headless browser), tmux (pipeline.status --watch is checked in a terminal) and
# prometheus (a real server scrapes a tiny job; promtool checks and unit-tests slurm/prometheus/alerts.yml).
# Idempotent: returns at once when all are installed.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
{ command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-test-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
