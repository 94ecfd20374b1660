#!/usr/bin/env bash
# Local SLURM cluster for tests and demos: see slurm/README.md and slurm/cluster.py.
#   slurm/cluster.sh up|down|status|env|kill-node NODE|start-node NODE [--dir DIR] [--nodes N] [--timeout S]
# The directory defaults to $SLURM_LOCAL_DIR, else <repo>/.slurm. Needs root. Uses only the Python stdlib.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$(command -v python3 || true)"
[[ -n $py ]] || { echo "slurm/cluster.sh: python3 not found" >&2; exit 1; }
exec "$py" "$here/cluster.py" "$@"
