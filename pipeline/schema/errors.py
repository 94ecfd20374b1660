"""The configuration error every layer raises (bottom layer: imports nothing from the project)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid. The message starts with the dotted key."""
