"""The registry of pretraining source formats (``data.sources[].format``): name -> :class:`Format`.

A new format is one module here (a :class:`~engine.data.formats.base.Format` subclass: ``detect``/``matches``,
``units``, ``records``), one entry in ``FORMATS`` and its name in ``pipeline.schema.sections.SOURCE_FORMATS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.data.formats.arrow import Hf, Parquet
from engine.data.formats.base import Bad, Format, Unit, list_files
from engine.data.formats.delimited import Csv
from engine.data.formats.jsonl import Jsonl, first_record
from engine.data.formats.megatron import Megatron, prefix_tokens
from engine.data.formats.text import Shakespeare, Text

FORMATS: dict[str, Format] = {
    f.name: f for f in (Megatron(), Hf(), Text(), Jsonl(), Parquet(), Csv(), Shakespeare())
}
"""Every format by name, in auto-detection order (whole-path formats by ``detect``, files by suffix)."""

__all__ = [
    "FORMATS",
    "Bad",
    "Format",
    "Unit",
    "check_chat_file",
    "check_source",
    "file_format",
    "source_format",
    "source_size",
]


def file_format(path: Path) -> str | None:
    """The format reading ``path`` by its name, or None."""
    return next((name for name, f in FORMATS.items() if f.matches(path)), None)


def source_format(src: Any, key: str) -> str:
    """The concrete format of a source (``auto`` resolved from its path)."""
    if src.format != "auto":
        return str(src.format)
    for name, f in FORMATS.items():
        if f.detect(src.path):
            return name
    files = list_files(src, key, lambda p: file_format(p) is not None, None)
    fmts = {file_format(f) for f in files}
    if len(fmts) != 1:
        raise ValueError(
            f"{key}.path={src.path!r}: mixed formats {sorted(map(str, fmts))}; give one format per source"
        )
    return str(fmts.pop())


def check_source(src: Any, key: str) -> list[str]:
    """Pre-flight, before any job: each file of a source passes its format's sample check (``check_sample``)."""
    try:
        fmt = FORMATS[source_format(src, key)]
        files = fmt.files(src, key)
    except ValueError:  # missing or mixed: the pre-flight file checks or data_prep name it
        return []
    return [p for f in files for p in fmt.check_sample(src, key, f)]


def source_size(src: Any, key: str, enough: int) -> tuple[int, int]:
    """Pre-flight size of a source: (bytes of text to tokenize, tokens it already holds); reading stops once
    ``enough`` bytes are certain. A missing or mixed source counts 0 (the pre-flight's file checks name it)."""
    try:
        fmt = FORMATS[source_format(src, key)]
        if fmt.tokenized:
            return 0, prefix_tokens(src.path)[1] if fmt.detect(src.path) else 0
        files = fmt.files(src, key)
    except ValueError:
        return 0, 0
    size = 0
    for f in files:
        size += fmt.text_bytes(f, enough - size)
        if size >= enough:
            break
    return size, 0


def check_chat_file(path: Path, key: str, shapes: tuple[tuple[str, ...], ...]) -> list[str]:
    """Pre-flight of a users' chat data file (JSON lines, plain or .gz/.zst, or Parquet): its first record (its
    columns) holds one of ``shapes`` (alternative sets of fields); [] when good, else one line."""
    want = " or ".join("+".join(s) for s in shapes)
    if path.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            names = set(pq.ParquetFile(path).schema_arrow.names)
        except Exception as e:  # pyarrow raises several types for a damaged file
            return [f"{key}: {path}: not a readable Parquet file: {e}"]
        ok = any(set(s) <= names for s in shapes)
        return [] if ok else [f"{key}: {path}: needs columns {want} (columns: {sorted(names)})"]

    def problem(rec: Any) -> str | None:
        if isinstance(rec, dict) and any(all(k in rec for k in s) for s in shapes):
            return None
        return f"a record needs {want}"

    return first_record(path, key, problem)
