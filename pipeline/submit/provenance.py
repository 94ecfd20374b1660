"""Provenance of a run: resolved config, git commit of the code, installed package versions."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from pipeline.records.files import atomic_write_text
from pipeline.schema.config import PipelineConfig

KEY_PACKAGES = (
    "torch",
    "megatron-core",
    "hydra-core",
    "omegaconf",
    "submitit",
    "tokenizers",
    "numpy",
    "mpi4py",
)
REPO_ROOT = Path(__file__).resolve().parents[2]


def git_state(repo: Path = REPO_ROOT) -> dict[str, object]:
    """Commit and dirtiness of the code's checkout (None where it is not a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def package_versions() -> dict[str, str]:
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out[name] = dist.version
    return dict(sorted(out.items(), key=lambda kv: kv[0].lower()))


def write_provenance(cfg: PipelineConfig, run_dir: Path) -> Path:
    """Write provenance/{config.json,git.json,packages.json}; the newest submission's set replaces the last."""
    from omegaconf import OmegaConf

    d = Path(run_dir) / "provenance"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    git = {**git_state(), "recorded_at": time.time(), "argv": sys.argv}
    atomic_write_text(d / "git.json", json.dumps(git, indent=2))
    pkgs = package_versions()
    summary = {k: pkgs.get(k) for k in KEY_PACKAGES}
    info = {"python": sys.version, "platform": platform.platform(), "key": summary, "all": pkgs}
    atomic_write_text(d / "packages.json", json.dumps(info, indent=2))
    return d
