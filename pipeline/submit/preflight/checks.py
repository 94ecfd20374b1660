"""The pre-flight's registry (``reads``: which stage a check reads for) and its primitives: the one error
shape, files and directories that must be there."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError, missing

Check = Callable[[PipelineConfig, str], None]
CHECKS: dict[str, list[Check]] = {}
"""Stage name -> the checks of what it reads, in registration order."""

INIT_FROM_SCHEMES: dict[str, Callable[[PipelineConfig, str, str], None]] = {}
"""``<scheme>:<rest>`` values of ``<stage>.init_from`` (e.g. a Hugging Face import) -> their check
``(cfg, stage, value)``; plain values are checkpoint paths."""

CHECKPOINT_MARKER = "COMPLETE.json"
"""The completion marker of a committed checkpoint (engine.checkpoint.layout.MARKER; a test keeps them equal)."""
TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
ITER_DIR = re.compile(r"^iter_(\d{7})$")
# ModelConfig keys that decide the shape of the saved weights.
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "normalization",
    "activation",
    "position_embedding",
    "add_bias_linear",
    "tie_embeddings",
    "make_vocab_size_divisible_by",
)


def reads(*stages: str) -> Callable[[Check], Check]:
    """Register ``check`` as reading inputs of ``stages``."""

    def add(check: Check) -> Check:
        for s in stages:
            CHECKS.setdefault(s, []).append(check)
        return check

    return add


def fail(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}")


def check_file(key: str, value: str, path: Path, *, nonempty: bool = True) -> None:
    """``path`` exists, is a regular file, is readable and (``nonempty``) holds something."""
    if not path.exists():
        fail(key, value, missing(path))
    if not path.is_file():
        fail(key, value, f"{path} is not a file")
    if not os.access(path, os.R_OK):
        fail(key, value, f"{path} is not readable (check its permissions)")
    if nonempty and path.stat().st_size == 0:
        fail(key, value, f"{path} is empty")


def check_dir(key: str, value: str, path: Path) -> None:
    if not path.exists():
        fail(key, value, missing(path))
    if not path.is_dir():
        fail(key, value, f"{path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        fail(key, value, f"{path} is not readable (check its permissions)")
