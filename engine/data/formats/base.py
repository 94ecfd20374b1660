"""What every data format shares: the Format interface, units of work, malformed records, line reading.

A format (one module per family, registered in ``engine.data.formats.FORMATS``) answers three questions:
``detect`` (does this path hold my format: the sample check behind ``format: auto``), ``units`` (how a file is
cut into units of work that do not depend on the number of ranks) and ``records`` (the documents of one unit,
or :class:`Bad` for a malformed record, in file order).
"""

from __future__ import annotations

import glob
import math
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Unit:
    """One unit of work: part of one file of one source."""

    index: int
    source: int
    fmt: str
    path: str
    start: int
    """Byte offset (text, jsonl), row group (parquet); 0 for whole files."""
    end: int
    """End byte (exclusive), row group + 1; -1 = to the end."""


class Bad:
    """A malformed record: where and why."""

    def __init__(self, where: str, reason: str, excerpt: str = "") -> None:
        self.where, self.reason, self.excerpt = where, reason, excerpt[:120]

    def message(self) -> str:
        return f"{self.where}: {self.reason}" + (f" ({self.excerpt!r})" if self.excerpt else "")


class Format:
    """A source format; subclasses override what differs from these defaults (files by suffix, whole-file units)."""

    name: str = ""
    suffixes: tuple[str, ...] = ()
    """File name endings this format reads (auto-detection of a file)."""
    tokenized: bool = False
    """True: the source is already token ids (megatron), joins the blend as is and has no units."""

    def detect(self, path: str) -> bool:
        """The sample check: ``path`` (a source's path as given) is this format as a whole (a folder, a prefix)."""
        return False

    def matches(self, path: Path) -> bool:
        """A file of this format (by its name)."""
        return bool(self.suffixes) and path.name.endswith(self.suffixes)

    def files(self, src: Any, key: str) -> list[Path]:
        """The source's files of this format, sorted."""
        return list_files(src, key, self.matches, self.name)

    def units(self, path: Path, shard_bytes: int) -> list[tuple[int, int]]:
        """(start, end) of each unit of ``path``: the whole file by default."""
        return [(0, -1)]

    def records(self, unit: Unit, src: Any) -> Iterator[str | Bad]:
        """The documents of one unit (or Bad for malformed records), in file order."""
        raise NotImplementedError(self.name)

    def check_sample(self, src: Any, key: str, path: Path) -> list[str]:
        """Pre-flight, before any job: problems with the first record of ``path`` (none checked by default)."""
        return []

    def text_bytes(self, path: Path, enough: int) -> int:
        """Pre-flight size estimate: at most this many bytes of text in ``path``, or any number >= ``enough``
        once that many are certain (a compressed file is read no further); the file's size by default."""
        return path.stat().st_size


def list_files(src: Any, key: str, accept: Callable[[Path], bool], label: str | None) -> list[Path]:
    """A source's files, sorted: a glob's hits, a directory's accepted files, or the file itself.

    ``label`` names the format; with it a glob keeps only accepted files (None: every hit, for auto-detection).
    """
    p = Path(src.path)
    if glob.has_magic(src.path):
        hits = sorted(Path(x) for x in glob.glob(src.path, recursive=True) if Path(x).is_file())
    elif p.is_dir():
        hits = sorted(x for x in p.rglob("*") if x.is_file() and accept(x))
    elif p.is_file():
        hits = [p]
    else:
        raise ValueError(f"{key}.path={src.path!r}: no such file or directory")
    if label is not None:
        hits = [h for h in hits if accept(h) or p.is_file()]
    if not hits:
        raise ValueError(f"{key}.path={src.path!r}: matches no {label or 'supported'} file")
    return hits


def byte_ranges(path: Path, shard_bytes: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of ``shard_bytes`` covering a file (one empty range for an empty file)."""
    size = path.stat().st_size
    return [(lo, min(lo + shard_bytes, size)) for lo in range(0, max(size, 1), shard_bytes)]


def lines(path: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines starting in [start, end) of a plain file."""
    with open(path, "rb") as f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":  # mid-line: that line belongs to the previous unit
                pos = start + len(f.readline())
        f.seek(pos)
        while pos < end:
            line = f.readline()
            if not line:
                break
            yield pos, line
            pos += len(line)


def line_number(path: str, offset: int) -> int:
    """1-based line number of the line starting at ``offset`` (only computed for error messages)."""
    n = 1
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def is_null(value: Any) -> bool:
    """A missing value as the formats give it: JSON null, an Arrow null (None) or a float NaN (pandas' null)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def template_problem(rec: dict[str, Any], template: str) -> str | None:
    """Why ``template`` cannot be filled from ``rec`` (a field it names is absent or null), else None."""
    for name in template_fields(template):
        if name not in rec:
            return f"template {template!r}: missing field {name!r}"
        if is_null(rec[name]):
            return f"template {template!r}: field {name!r} is null"
    return None


def from_record(rec: Any, src: Any) -> str | Bad:
    """A record's document: ``src.template`` over its fields, else its string field ``src.text_field``.

    A template over a missing or null field is a malformed record (never the text ``"None"``)."""
    if not isinstance(rec, dict):
        return Bad("", "record is not an object")
    if src.template:
        problem = template_problem(rec, src.template)
        if problem:
            return Bad("", problem)
        try:
            return str(src.template.format_map(rec))
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
            return Bad("", f"template {src.template!r}: cannot fill it ({type(e).__name__}: {e})")
    value = rec.get(src.text_field)
    if not isinstance(value, str):
        return Bad("", f"no string field {src.text_field!r}")
    return value


def template_fields(template: str) -> list[str]:
    """The record fields a template names (sorted; ``{a.b}`` and ``{a[0]}`` name ``a``)."""
    return sorted(
        {re.split(r"[.\[]", f, maxsplit=1)[0] for _, f, _, _ in string.Formatter().parse(template) if f}
    )


def columns(src: Any) -> list[str]:
    """The fields a record needs (sorted): those the template names, else ``text_field``."""
    if src.template:
        return template_fields(src.template)
    return [src.text_field]
