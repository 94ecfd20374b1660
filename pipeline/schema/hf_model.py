"""``hf:<dir>`` model references in the config: architecture and tokenizer from a Hugging Face directory.

What the plan needs is separate from what a run needs. ``apply(pc, origins)`` runs inside ``build_config`` for
every command, the planner's included (no torch; reads config.json, and tokenizer_config.json when there for a
chat template), so ``python -m pipeline``, ``pipeline.plan`` and ``pipeline.schema.layout`` see the same
resolved model from config.json alone. ``RUN_FILES`` are what a run reads besides (tokenizer, weights):
``check_run_files`` is the run's pre-flight of them (pipeline.submit.preflight), ``missing_run_files`` what the
planner names as still needed.

- every ``<stage>.init_from=hf:<dir>`` and ``eval.models`` entry ``hf:<dir>`` of the run must name the same
  directory; its config.json must describe a supported model (pipeline.schema.hf_arch), else a
  config error naming the field;
- the architecture keys of ``model`` are taken from config.json; a key the user set (on the command line or in
  a file of their own, whatever its value: ``origins``) to something else is a config error naming both
  values; a shipped preset's keys (``experiment=tiny``, the model group) give way;
- the run's tokenizer is the directory's (``data.tokenizer_path``), used as it is (no token appended): its
  tokenizer_config.json names the eos token (else it must hold the pipeline's role tokens), it fits the
  model's vocabulary (both checked by the pre-flight), and the run's data is rendered with the directory's own
  chat template (``data.chat_template=tokenizer``, unless the user chose a template file).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.schema.config import ModelConfig, PipelineConfig
from pipeline.schema.errors import ConfigError, missing
from pipeline.schema.graph import TRAIN_STAGES
from pipeline.schema.origins import HF, Origin, Origins

ROLE_TOKENS = ("<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>")
"""The special tokens data_prep and the engine use (engine.data.datasets.SPECIAL_TOKENS)."""


@dataclass(frozen=True)
class RunFile:
    """Files of an ``hf:<dir>`` that a run reads and the plan does not: ``pattern`` (a glob) in the directory."""

    what: str
    pattern: str
    why: str

    def present(self, hf_dir: Path) -> bool:
        return any(hf_dir.glob(self.pattern))


RUN_FILES = (
    RunFile("tokenizer", "tokenizer.json", "the run uses the model's own tokenizer"),
    RunFile("weights", "*.safetensors", "the run starts from the model's weights"),
)
"""What a run reads from its ``hf:<dir>`` besides config.json (the planner reads config.json alone)."""


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


def model_ref(pc: PipelineConfig) -> tuple[str, str, Path] | None:
    """(config key, ``hf:<dir>`` value, resolved directory) of the model the run starts from (None: none);
    two different directories are a config error."""
    found = refs(pc)
    if not found:
        return None
    dirs = {Path(v[3:]).expanduser().resolve() for v in found.values()}
    key, value = next(iter(found.items()))
    if len(dirs) > 1:
        raise ConfigError(
            f"{key}={value!r}: a run starts from one Hugging Face model, got {sorted(found.values())}"
        )
    return key, value, dirs.pop()


def apply(pc: PipelineConfig, origins: Origins) -> tuple[PipelineConfig, Origins]:
    """``pc`` with model and tokenizer taken from its ``hf:`` reference (unchanged without one), and the origins
    of the values taken from the directory. Reads config.json alone: what a run also needs is the pre-flight's
    (``check_run_files``)."""
    from pipeline.schema.hf_arch import HFConfigError, arch_values, read_config

    ref = model_ref(pc)
    if ref is None:
        return pc, origins
    key, value, hf_dir = ref
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
    new = {k: Origin(HF, where, choice=f"{key}={value}") for k, where in taken.items()}
    return dataclasses.replace(pc, model=model, data=data), origins.updated(new)


def missing_run_files(hf_dir: Path) -> list[RunFile]:
    """The RUN_FILES not in ``hf_dir``: what a run from it still needs (the planner names them)."""
    return [f for f in RUN_FILES if not f.present(hf_dir)]


def check_run_files(pc: PipelineConfig) -> None:
    """The run's pre-flight of its ``hf:<dir>`` (nothing without one): every RUN_FILES file is there and the
    tokenizer fits the model (``check_tokenizer``); a config error names each missing file."""
    ref = model_ref(pc)
    if ref is None:
        return
    key, value, hf_dir = ref
    missing_files = missing_run_files(hf_dir)
    if missing_files:
        raise ConfigError(
            f"{key}={value!r}: "
            + "; ".join(f"{hf_dir / f.pattern}: no such file ({f.why})" for f in missing_files)
        )
    check_tokenizer(hf_dir, pc.model, key, value, needs_roles=pc.data.chat_template == "project")


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
    """The directory's tokenizer.json (there: ``check_run_files``): loadable, its eos (and pad) token in its
    vocabulary, every id within the model's vocabulary; with ``needs_roles`` (the project template) also the
    pipeline's role tokens."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
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
