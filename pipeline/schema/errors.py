"""The configuration error every layer raises, and the wording of a path that is not there (bottom layer:
imports nothing from the project)."""

from __future__ import annotations

import os
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is invalid. The message starts with the dotted key."""


def resolved_against(path: str | Path) -> str:
    """For a relative path, where it was looked for: `` (a relative path, resolved against the working
    directory <cwd>)``; for an absolute one nothing."""
    if Path(path).expanduser().is_absolute():
        return ""
    return f" (a relative path, resolved against the working directory {os.getcwd()})"


def missing(path: str | Path, kind: str = "") -> str:
    """``<path> does not exist``, saying for a relative path which directory it was resolved against (or,
    with ``kind``, ``<path> is not a <kind>`` when something else is there)."""
    if kind and Path(path).expanduser().exists():
        return f"{path} is not a {kind}"
    return f"{path} does not exist{resolved_against(path)}"
