#!/usr/bin/env bash
# Install what the local SLURM test cluster (slurm/cluster.py) needs on Debian 12, as root.
#
# Idempotent: installs only the packages that are missing and runs `apt-get update` only then.
# Non-interactive. Package services are NOT started by the install (a temporary policy-rc.d
# denies it, unless the machine already has one): the cluster runs its own private daemons.
#
#   sudo slurm/install.sh          # or as root in CI
#   slurm/install.sh --check       # only report what is missing (exit 1 if anything is)
set -euo pipefail

PACKAGES=(
  munge          # munged, mungekey
  slurmctld      # controller
  slurmd         # node daemon (+ slurmstepd)
  slurm-client   # sbatch, srun, squeue, sinfo, sacct, sacctmgr, scontrol, scancel
  slurmdbd       # accounting daemon (sacct needs it)
  mariadb-server # database behind slurmdbd (mariadbd, mariadb-install-db)
  mariadb-client # mariadb CLI used to create the accounting user
  util-linux     # unshare, setsid
  procps         # ps, used in diagnostics
)

log() { echo "[slurm/install.sh] $*"; }

missing=()
for p in "${PACKAGES[@]}"; do
  if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    log "present: $p"
  else
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  log "all packages present; nothing to do"
  exit 0
fi

log "missing: ${missing[*]}"
if [[ "${1:-}" == "--check" ]]; then
  exit 1
fi

if [[ $(id -u) -ne 0 ]]; then
  log "must run as root to install packages (try: sudo $0)" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  log "apt-get not found: this script supports Debian/Ubuntu only" >&2
  exit 1
fi

# Keep the packages' own services from starting (they would use /etc configs and default ports).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
  log "creating temporary $policy (deny service starts during install)"
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  created_policy=1
fi
cleanup() {
  if [[ $created_policy -eq 1 ]]; then
    log "removing temporary $policy"
    rm -f "$policy"
  fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
log "apt-get update"
apt-get update -q
log "apt-get install ${missing[*]}"
apt-get install -y -q --no-install-recommends "${missing[@]}"

for b in munged mungekey slurmctld slurmd slurmdbd sbatch sacct sacctmgr mariadbd mariadb-install-db mariadb unshare setsid; do
  if ! command -v "$b" >/dev/null && [[ ! -x /usr/sbin/$b ]]; then
    log "ERROR: $b not found after install" >&2
    exit 1
  fi
done
log "done: $(slurmctld -V 2>/dev/null || true), $(mariadbd --version 2>/dev/null | head -1 || true)"
