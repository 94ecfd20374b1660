"""``hf:<dir>`` model references in the config: architecture and tokenizer from a Hugging Face directory.

``apply(pc, origins)`` runs inside ``build_config`` (no torch; reads config.json and tokenizer.json only), so
``python -m pipeline``, ``pipeline.schema.layout`` and every companion command see the same resolved model:

- every ``<stage>.init_from=hf:<dir>`` and ``eval.models`` entry ``hf:<dir>`` of the run must name the same
  directory; its config.json must describe a supported model (pipeline.schema.hf_arch), else a
  config error naming the field;
- the architecture keys of ``model`` are taken from config.json; a key the user set (on the command line or in
  a file of their own, whatever its value: ``origins``) to something else is a config error naming both
  values; a shipped preset's keys (``experiment=tiny``, the model group) give way;
- the run's tokenizer is the directory's (``data.tokenizer_path``), used as it is (no token appended): its
  tokenizer_config.json names the eos token (else it must hold the pipeline's role tokens), it fits the
  model's vocabulary, and the run's data is rendered with the directory's own chat template
  (``data.chat_template=tokenizer``, unless the user chose a template file).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pipeline.schema.config import ModelConfig, PipelineConfig
from pipeline.schema.errors import ConfigError, missing
from pipeline.schema.graph import TRAIN_STAGES
from pipeline.schema.origins import HF, Origin, Origins

ROLE_TOKENS = ("<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>")
"""The special tokens data_prep and the engine use (engine.data.datasets.SPECIAL_TOKENS)."""


def refs(pc: PipelineConfig) -> dict[str, str]:
    """``{config key: hf:<dir> value}`` for every Hugging Face reference of the stages in the run."""
    out: dict[str, str] = {}
    for name in TRAIN_STAGES:
        value = getattr(pc, name).init_from
        if name in pc.run.stages and isinstance(value, str) and value.startswith("hf:"):
            out[f"{name}.init_from"] = value
    if "eval" in pc.run.stages:
        for m in pc.eval.models:
            if m.startswith("hf:"):
                out["eval.models"] = m
    return out


def apply(pc: PipelineConfig, origins: Origins) -> tuple[PipelineConfig, Origins]:
    """``pc`` with model and tokenizer taken from its ``hf:`` reference (unchanged without one), and the origins
    of the values taken from the directory."""
    from pipeline.schema.hf_arch import HFConfigError, arch_values, read_config

    found = refs(pc)
    if not found:
        return pc, origins
    dirs = {Path(v[3:]).expanduser().resolve() for v in found.values()}
    key, value = next(iter(found.items()))
    if len(dirs) > 1:
        raise ConfigError(
            f"{key}={value!r}: a run starts from one Hugging Face model, got {sorted(found.values())}"
        )
    hf_dir = dirs.pop()
    if not hf_dir.is_dir():
        raise ConfigError(f"{key}={value!r}: {missing(Path(value[3:]).expanduser(), 'directory')}")
    config_json = hf_dir / "config.json"
    try:
        values = arch_values(read_config(hf_dir), str(config_json))
    except HFConfigError as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None
    for k, v in values.items():  # what the user set must agree; a shipped preset's sizes give way
        if origins.user_set(f"model.{k}") and getattr(pc.model, k) != v:
            raise ConfigError(
                f"model.{k}={getattr(pc.model, k)!r}: contradicts {config_json}'s {v!r} ({key}={value!r}; "
                f"drop model.{k} or use another model)"
            )
    extra: dict[str, Any] = {}
    if not origins.user_set("model.name"):
        extra["name"] = hf_dir.name
    if not origins.user_set("model.make_vocab_size_divisible_by"):
        extra["make_vocab_size_divisible_by"] = 1  # a published vocabulary is padded for TP only
    model = dataclasses.replace(pc.model, **values, **extra)
    taken = {f"model.{k}": str(config_json) for k in values if not origins.user_set(f"model.{k}")}
    taken |= {f"model.{k}": str(hf_dir) for k in extra}
    data = pc.data
    if data.tokenizer_path is None:
        data = dataclasses.replace(data, tokenizer_path=str(hf_dir))
        taken["data.tokenizer_path"] = str(hf_dir)
    elif Path(data.tokenizer_path).expanduser().resolve() not in (hf_dir, hf_dir / "tokenizer.json"):
        raise ConfigError(
            f"data.tokenizer_path={data.tokenizer_path!r}: a run starting from {value} uses that model's "
            "tokenizer; drop data.tokenizer_path"
        )
    if (
        data.chat_template == "project"
        and not origins.user_set("data.chat_template")
        and _has_chat_template(hf_dir)
    ):
        data = dataclasses.replace(data, chat_template="tokenizer")
        taken["data.chat_template"] = str(hf_dir)
    check_tokenizer(hf_dir, model, key, value, needs_roles=data.chat_template == "project")
    new = {k: Origin(HF, where, choice=f"{key}={value}") for k, where in taken.items()}
    return dataclasses.replace(pc, model=model, data=data), origins.updated(new)


def _has_chat_template(hf_dir: Path) -> bool:
    if (hf_dir / "chat_template.jinja").is_file():
        return True
    cfg = hf_dir / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def _special_token(hf_dir: Path, name: str) -> str | None:
    """``eos_token`` / ``pad_token`` of tokenizer_config.json (else special_tokens_map.json): str or {content}."""
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        if (hf_dir / f).is_file():
            v = json.loads((hf_dir / f).read_text()).get(name)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and v:
                return v
    return None


def check_tokenizer(hf_dir: Path, model: ModelConfig, key: str, value: str, needs_roles: bool = False) -> int:
    """The directory's tokenizer.json: loadable, its eos (and pad) token in its vocabulary, every id within
    the model's vocabulary; with ``needs_roles`` (the project template) also the pipeline's role tokens."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{key}={value!r}: {path}: no such file (the run uses the model's own tokenizer)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception
        raise ConfigError(f"{key}={value!r}: {path}: not a tokenizers JSON: {e}") from None
    eos = _special_token(hf_dir, "eos_token")
    if eos is None:
        needs_roles = True  # no eos named: the pipeline's own kind of tokenizer
    for name, token in (("eos_token", eos), ("pad_token", _special_token(hf_dir, "pad_token"))):
        if token is not None and tok.token_to_id(token) is None:
            raise ConfigError(
                f"{key}={value!r}: {hf_dir / 'tokenizer_config.json'}: {name}={token!r} is not in {path}"
            )
    missing = [t for t in ROLE_TOKENS if tok.token_to_id(t) is None]
    if needs_roles and missing:
        raise ConfigError(
            f"{key}={value!r}: {hf_dir} has no chat_template (tokenizer_config.json) and {path} lacks the "
            f"pipeline's role tokens {missing}: give data.chat_template=<template.jinja> (tokens are never "
            "appended to a published vocabulary)"
        )
    size = tok.get_vocab_size(with_added_tokens=True)
    if model.vocab_size is not None and size > model.vocab_size:
        raise ConfigError(
            f"{key}={value!r}: tokenizer vocabulary {size} ({path}) exceeds the model's vocab_size "
            f"{model.vocab_size} (config.json)"
        )
    return size
