"""``init_from``: a complete checkpoint of the model's shape, or a scheme such as ``hf:<dir>``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.schema.config import ModelConfig, PipelineConfig, TrainStage
from pipeline.schema.graph import TRAIN_STAGES
from pipeline.submit.preflight.checks import (
    CHECKPOINT_MARKER,
    INIT_FROM_SCHEMES,
    ITER_DIR,
    SHAPE_KEYS,
    check_dir,
    fail,
    reads,
)

# ---------------------------------------------------------------------------- init_from


@reads(*TRAIN_STAGES)
def _init_from(cfg: PipelineConfig, stage: str) -> None:
    """A given ``init_from`` is a complete checkpoint whose model shape matches ``model``."""
    st = cfg.stage(stage)
    assert isinstance(st, TrainStage)
    value = st.init_from
    if value is None or value in ("auto", "", "none", "null"):
        return
    key = f"{stage}.init_from"
    scheme = re.match(r"^([a-z][a-z0-9+]*):(?!//)", value)
    if scheme and not Path(value).exists():
        name = scheme.group(1)
        if name not in INIT_FROM_SCHEMES:
            fail(
                key,
                value,
                f"unknown scheme {name!r}: use auto, null, a checkpoint path or {sorted(INIT_FROM_SCHEMES)}",
            )
        INIT_FROM_SCHEMES[name](cfg, stage, value)
        return
    ckpt = checkpoint_dir(key, value)
    check_marker(key, value, ckpt)
    check_shape(key, value, ckpt, cfg)


def _hf_init_from(cfg: PipelineConfig, stage: str, value: str) -> None:
    """``hf:<dir>``: a Hugging Face model directory. Its config.json was read by pipeline.schema.hf_model.apply,
    and what a run reads besides (tokenizer, weights) was checked once for the whole run, before the stages'
    checks (preflight: hf_model.check_run_files): nothing is left to check here."""


INIT_FROM_SCHEMES["hf"] = _hf_init_from


def checkpoint_dir(key: str, value: str) -> Path:
    """The checkpoint ``value`` names: a committed ``iter_*`` directory, or a root holding them (newest
    with a marker), as ``Checkpointer`` resolves it in the job."""
    path = Path(value)
    check_dir(key, value, path)
    if (path / CHECKPOINT_MARKER).is_file():
        return path
    iters = sorted(
        (p for p in path.iterdir() if ITER_DIR.match(p.name) and (p / CHECKPOINT_MARKER).is_file()),
        reverse=True,
    )
    if not iters:
        temp = [p.name for p in path.iterdir() if p.name.startswith(("iter_", "tmp.iter_"))]
        what = f"only incomplete saves ({', '.join(sorted(temp))})" if temp else "no checkpoint"
        fail(
            key,
            value,
            f"{what} here: give a checkpoint directory with {CHECKPOINT_MARKER} (a completed save) or a "
            "checkpoints/ folder holding one",
        )
    return iters[0]


def check_marker(key: str, value: str, ckpt: Path) -> dict[str, Any]:
    """The marker reads, lists files, and each listed file is there with its recorded size."""
    marker = ckpt / CHECKPOINT_MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        fail(key, value, f"{marker} is unreadable ({e}): the checkpoint is not complete")
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or not meta["files"]:
        fail(key, value, f"{marker} lists no files: not a complete checkpoint")
    for rel, rec in sorted(meta["files"].items()):
        p = ckpt / rel
        if not p.is_file():
            fail(key, value, f"{p} is missing (listed in {CHECKPOINT_MARKER}): the checkpoint is damaged")
        if isinstance(rec, dict) and "size" in rec and p.stat().st_size != rec["size"]:
            fail(key, value, f"{p} has {p.stat().st_size} bytes, {CHECKPOINT_MARKER} records {rec['size']}")
    return dict(meta)


def saved_config(ckpt: Path) -> tuple[Path, dict[str, Any]] | None:
    """(run directory, recorded config) of the run that wrote ``ckpt`` (run_dir/provenance/config.yaml), if
    the checkpoint sits in a run directory (<run_dir>/stages/<stage>/checkpoints/iter_*)."""
    for parent in list(ckpt.resolve().parents)[:5]:
        cfg_file = parent / "provenance" / "config.yaml"
        if cfg_file.is_file() and (parent / "ledger").is_dir():
            from omegaconf import OmegaConf

            data = OmegaConf.to_container(OmegaConf.load(cfg_file))
            return (parent, {str(k): v for k, v in data.items()}) if isinstance(data, dict) else None
    return None


def _vocab(model: dict[str, Any], data: dict[str, Any]) -> int | None:
    """The unpadded vocabulary a config trains with, when the config alone says it."""
    if model.get("vocab_size") is not None:
        return int(model["vocab_size"])
    if data.get("tokenizer_path") is None and data.get("vocab_size") is not None:
        return int(data["vocab_size"])
    return None


def check_shape(key: str, value: str, ckpt: Path, cfg: PipelineConfig) -> None:
    """The checkpoint's model (from its run's recorded config) has the shape ``cfg.model`` asks for."""
    found = saved_config(ckpt)
    if found is None:
        return  # a checkpoint outside a run directory: its shape is checked when the job loads it
    run_dir, saved_cfg = found
    saved = saved_cfg.get("model") or {}
    model: ModelConfig = cfg.model
    for k in SHAPE_KEYS:
        if k in saved and saved[k] != getattr(model, k):
            fail(
                key,
                value,
                f"the checkpoint's model has {k}={saved[k]!r} but model.{k}={getattr(model, k)!r}: use the "
                f"same model config as the run that saved it ({run_dir})",
            )
    import dataclasses

    old = _vocab(saved, saved_cfg.get("data") or {})
    new = _vocab(dataclasses.asdict(model), dataclasses.asdict(cfg.data))
    if old is not None and new is not None and old != new:
        fail(
            key,
            value,
            f"the checkpoint's vocabulary has {old} tokens, this run's {new} (model.vocab_size / "
            f"data.vocab_size): use the same tokenizer and vocabulary as the run that saved it ({run_dir})",
        )
