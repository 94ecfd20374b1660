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
HF_SOURCE = "hf_source"
"""provenance/hf_source/: config.json and generation_config.json of the Hugging Face model the run starts from
(``hf:<dir>``) as they were when it was submitted; its export keeps that model's pad_token_id."""
HF_SOURCE_FILES = ("config.json", "generation_config.json")


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
    """Write provenance/{config.yaml,git.json,packages.json} (and hf_source/ for a run from ``hf:<dir>``); the
    newest submission's set replaces the last."""
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
    model_dir = hf_model_dir(cfg)
    for name in HF_SOURCE_FILES:
        if model_dir is not None and (model_dir / name).is_file():
            atomic_write_text(d / HF_SOURCE / name, (model_dir / name).read_text(encoding="utf-8"))
    return d


def hf_model_dir(cfg: PipelineConfig) -> Path | None:
    """The Hugging Face directory the run's model comes from (``hf:<dir>``; pipeline.schema.hf_model)."""
    from pipeline.schema.hf_model import refs

    found = refs(cfg)
    return Path(next(iter(found.values()))[len("hf:") :]).expanduser() if found else None


def hf_source(run_dir: Path, cfg: PipelineConfig) -> Path | None:
    """Where the config.json of the Hugging Face model the run started from is: provenance's copy, else the
    directory itself (a run submitted before copies were kept); None for a model of the run's own."""
    kept = Path(run_dir) / "provenance" / HF_SOURCE
    if (kept / "config.json").is_file():
        return kept
    model_dir = hf_model_dir(cfg)
    return model_dir if model_dir is not None and (model_dir / "config.json").is_file() else None
