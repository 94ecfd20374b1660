"""Numeric domains of schema fields (``num(default, ...)``) and the checks every config section runs.

``fail`` and ``choice`` raise the one error shape of the schema: ``ConfigError("<key>=<value>: <what is
allowed>")``; ``build_config`` (pipeline.schema.build) prefixes the key with its dotted section path.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.schema.errors import ConfigError


def fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r}: {allowed}")


def choice(key: str, value: Any, choices: tuple[Any, ...] | list[Any]) -> None:
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    fail(key, value, f"must be one of {list(choices)}{hint}")


@dataclass(frozen=True)
class Domain:
    """The values a numeric key accepts: its kind (integer or finite number) and bounds; None = allowed.

    Declared in the schema with ``num(default, ...)``; checked for every numeric field by ``check_domains``
    (a test asserts that every numeric field of every dataclass has one).
    """

    integer: bool
    """Integers only (else any finite number; NaN and infinities are never allowed)."""
    ge: float | None = None
    """Lower bound, inclusive."""
    gt: float | None = None
    """Lower bound, exclusive."""
    le: float | None = None
    """Upper bound, inclusive."""
    lt: float | None = None
    """Upper bound, exclusive."""
    or_zero: bool = False
    """0 is also allowed (it means 'off')."""
    or_word: str | None = None
    """This word is also allowed (e.g. ``auto``: the value is chosen at run time)."""

    def describe(self) -> str:
        bounds = [
            f"{op} {_fmt(v)}"
            for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if v is not None
        ]
        kind = "an integer" if self.integer else "a finite number"
        text = f"{kind} {' and '.join(bounds)}" if bounds else kind
        text = f"0 (off) or {text}" if self.or_zero else text
        return f"{self.or_word} or {text}" if self.or_word else text

    def ok(self, value: Any) -> bool:
        if self.or_word is not None and value == self.or_word:
            return True
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.or_zero and value == 0:
            return True
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)


def num(
    default: Any,
    *,
    integer: bool | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    or_zero: bool = False,
    or_word: str | None = None,
) -> Any:
    """A numeric schema field with its domain (None stays allowed for ``X | None`` fields); a list default:
    a list of numbers, each in the domain; ``or_word``: a word also allowed (``int | str`` fields)."""
    kind = isinstance(default, int) if integer is None else integer
    dom = Domain(kind, ge=ge, gt=gt, le=le, lt=lt, or_zero=or_zero, or_word=or_word)
    if isinstance(default, list):
        items = list(default)
        return field(default_factory=lambda: list(items), metadata={"domain": dom})
    return field(default=default, metadata={"domain": dom})


def domain_of(f: dataclasses.Field) -> Domain | None:
    return f.metadata.get("domain") if f.metadata else None


def check_domains(obj: Any) -> None:
    """Every numeric field of dataclass ``obj`` against its declared domain (None passes: 'not set')."""
    for f in dataclasses.fields(obj):
        dom = domain_of(f)
        value = getattr(obj, f.name)
        if dom is None or value is None:
            continue
        if isinstance(value, list) and not all(dom.ok(v) for v in value):
            fail(f.name, value, f"each entry must be {dom.describe()}")
        if not isinstance(value, list) and not dom.ok(value):
            fail(f.name, value, f"must be {dom.describe()}")
