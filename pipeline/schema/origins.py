"""Where each value of a composed config came from: a command-line override, a line of a YAML file (picked by
which group choice), a Hugging Face model's config.json, or the schema default.

``pipeline.schema.compose.compose_traced`` records an ``Origins`` once, at composition; it travels as an
argument into ``build_config``, ``hf_model.apply`` and the ignored-key checks, which ask what the user set
(``user_set``) instead of comparing values with defaults, and into every error message (``annotate``): an
error naming a key the user did not type says where its value came from. Plain data, no Hydra.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OVERRIDE = "override"
FILE = "file"
HF = "hf"
GIVEN = "given"
"""Kinds of origin: the command line, a YAML file, an ``hf:<dir>`` model's config.json, a config given as a plain
mapping (no composition to trace: a value that differs from the schema default counts as set)."""


@dataclass(frozen=True)
class Origin:
    """Who set one key's value."""

    kind: str
    """OVERRIDE, FILE, HF or GIVEN."""
    where: str = ""
    """The override as typed, the YAML file or config.json (as shown in messages)."""
    line: int | None = None
    """Line of the key in ``where`` (FILE)."""
    choice: str = ""
    """What brought ``where`` in: a group choice (``experiment=tiny``) or an hf: reference (``sft.init_from=hf:...``)."""
    chosen: bool = True
    """The group choice was the user's (command line), not conf/config.yaml's default."""
    user: bool = False
    """The user set it: on the command line or in a file of their own (outside the shipped conf/)."""

    def describe(self) -> str:
        """``the command line (k=v)``, ``conf/experiment/tiny.yaml:14 (experiment=tiny)``, ..."""
        if self.kind == OVERRIDE:
            return f"the command line ({self.where})"
        loc = f"{self.where}:{self.line}" if self.line else self.where
        if not self.choice:
            return loc
        return f"{loc} ({self.choice}{'' if self.chosen else ', the default'})"


_KEY = re.compile(r"(?<![\w.\[\]'\"/-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*|\[\d+\])+)=")
"""A dotted key written ``key=`` in an error message."""


@dataclass(frozen=True)
class Origins:
    """``{dotted key: Origin}`` for every key something other than the schema set; list items as ``key[i]``.

    A list is set as a whole (its items' keys are recorded too, for their lines); a mapping is merged key by key,
    so only its leaves are recorded.
    """

    keys: Mapping[str, Origin] = field(default_factory=dict)

    def of(self, key: str) -> Origin | None:
        """The origin of ``key``'s value: its own, else the nearest enclosing list's (None: the schema default)."""
        k = key
        while k:
            if k in self.keys:
                return self.keys[k]
            k = parent(k)
        return None

    def under(self, key: str) -> Iterator[tuple[str, Origin]]:
        """``key`` and the keys below it that have an origin."""
        for k, o in self.keys.items():
            if k == key or k.startswith((key + ".", key + "[")):
                yield k, o

    def user_set(self, key: str) -> bool:
        """Whether the user set ``key`` (or a key below it): on the command line or in a file of their own."""
        return any(o.user for _, o in self.under(key))

    def updated(self, new: Mapping[str, Origin]) -> Origins:
        """These origins with ``new`` replacing those of its keys (and of the keys below them)."""
        keys = {k: o for k, o in self.keys.items() if not any(k == n or is_below(k, n) for n in new)}
        return Origins({**keys, **new})

    def note(self, key: str, values: Mapping[str, Any]) -> str | None:
        """Where ``key``'s value came from, for a message (None: typed on the command line, or not a key)."""
        o = self.of(key)
        if o is not None:
            return None if o.kind in (OVERRIDE, GIVEN) else f"{key} set at {o.describe()}"
        if key not in values:
            return None
        if values[key] is None:
            return f"{key} is not set (null, the schema default): its value is derived"
        return f"{key}={values[key]!r} is the schema default"

    def annotate(self, message: str, values: Mapping[str, Any]) -> str:
        """``message`` with, for each ``key=`` in it that the command line did not set, where its value came from."""
        notes: list[str] = []
        for key in dict.fromkeys(m.group(1) for m in _KEY.finditer(message)):
            n = self.note(key, values)
            if n is not None and n not in message:
                notes.append(n)
        return f"{message} [{'; '.join(notes)}]" if notes else message


def parent(key: str) -> str:
    """``a.b[0].c`` -> ``a.b[0]`` -> ``a.b`` -> ``a`` -> ``''``."""
    if key.endswith("]"):
        return key[: key.rindex("[")]
    return key.rpartition(".")[0]


def is_below(key: str, ancestor: str) -> bool:
    return key.startswith((ancestor + ".", ancestor + "["))


def join(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else key


def leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested mapping: scalars, lists (as a whole, then their items'
    leaves) and empty mappings."""
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            yield from leaves(v, join(prefix, str(k)))
        return
    if prefix:
        yield prefix, value
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, Mapping) or isinstance(item, list):
                yield from leaves(item, join(prefix, i))


class Recorder:
    """Builds ``Origins`` in composition order: each write replaces what earlier sources set at and below the key."""

    def __init__(self) -> None:
        self.keys: dict[str, Origin] = {}

    def write(self, data: Mapping[str, Any], prefix: str, origin_of: Any) -> None:
        """Record every leaf of ``data`` (under ``prefix``) with ``origin_of(relative key)``."""
        whole: list[str] = []
        for key, value in leaves(data, prefix):
            if any(is_below(key, w) for w in whole):  # an item of a list just written
                self.keys[key] = origin_of(key[len(prefix) + 1 :] if prefix else key)
                continue
            for k in [k for k in self.keys if is_below(k, key)]:
                del self.keys[k]
            self.keys[key] = origin_of(key[len(prefix) + 1 :] if prefix else key)
            if isinstance(value, list):
                whole.append(key)

    def origins(self) -> Origins:
        return Origins(dict(self.keys))


# ---------------------------------------------------------------------------- YAML files


def key_lines(text: str) -> dict[str, tuple[int, str]]:
    """``{dotted key: (line, value as written)}`` of a YAML document (list items as ``key[i]``; {} if it does not
    parse)."""
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[str, tuple[int, str]] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = join(prefix, str(k.value))
                out[key] = (k.start_mark.line + 1, _written(text, v))
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                key = join(prefix, i)
                out[key] = (item.start_mark.line + 1, _written(text, item))
                walk(item, key)

    walk(root, "")
    return out


def _written(text: str, node: Any) -> str:
    import yaml

    if isinstance(node, yaml.ScalarNode):
        return str(node.value)
    return " ".join(text[node.start_mark.index : node.end_mark.index].split())


YAML_HINTS: tuple[tuple[str, str], ...] = (
    ("that cannot start any token", "indent with spaces, not tabs"),
    (
        "mapping values are not allowed",
        "a line indented deeper than the key above it, or a value holding ': ' unquoted",
    ),
    ("expected <block end>", "a line indented less or more than its neighbours"),
    ("quoted scalar", "a quote opened on this line is never closed"),
)
"""(words of a YAML parser error, what usually causes it) for the one-line error."""


_KEY_LINE = re.compile(r"^([ \t]*)(?:-[ \t]+)?([^\s:#'\"-][^:#]*?)[ \t]*:(?:[ \t]+(.*?))?[ \t]*(?:#.*)?$")


def line_key(text: str, lineno: int) -> tuple[str, str]:
    """(dotted key, value) written on line ``lineno`` of a YAML text, its parents found by indentation."""
    lines = text.splitlines()
    if not 1 <= lineno <= len(lines):
        return "", "?"
    m = _KEY_LINE.match(lines[lineno - 1])
    if m is None:
        return "", lines[lineno - 1].strip() or "?"
    indent, parts = len(m.group(1)), [m.group(2).strip()]
    for prev in reversed(lines[: lineno - 1]):
        pm = _KEY_LINE.match(prev)
        if pm is None or pm.group(3):  # not a key, or a key with its value: not a parent
            continue
        if len(pm.group(1)) < indent:
            parts.insert(0, pm.group(2).strip())
            indent = len(pm.group(1))
            if indent == 0:
                break
    return ".".join(parts), (m.group(3) or "").strip() or "?"


def package_header(text: str) -> str | None:
    """The ``# @package <name>`` of a Hydra YAML file (``_global_`` -> ''), None without one."""
    m = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
    if m is None:
        return None
    return "" if m.group(1) == "_global_" else m.group(1)


def shown(path: Path, shipped: Path) -> str:
    """A file as messages show it: ``conf/...`` for the shipped configs, else its absolute path."""
    path = path.resolve()
    try:
        return str(path.relative_to(shipped.resolve().parent))
    except ValueError:
        return str(path)
