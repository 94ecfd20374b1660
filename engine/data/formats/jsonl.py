"""JSON lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and the project's one JSON-lines parser.

:func:`json_lines` parses every JSON-lines input (pretraining sources, corpus=files, users' chat data, the
generated task files); callers decide whether a bad line fails or is counted.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.data.formats.base import (
    Bad,
    Format,
    Unit,
    byte_ranges,
    from_record,
    line_number,
    lines,
    template_fields,
)


def json_lines(numbered: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, Any]]:
    """(number, record) of the non-blank lines; the record is a :class:`Bad` (no location) when a line is
    undecodable or not valid JSON."""
    for n, raw in numbered:
        if not raw.strip():
            continue
        try:
            yield n, json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            yield n, Bad("", f"undecodable UTF-8: {e.reason}")
        except json.JSONDecodeError as e:
            yield n, Bad("", f"not valid JSON: {e.msg}", raw.decode("utf-8", "replace"))


def numbered_lines(path: Path | str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a JSON-lines file, plain or .gz/.zst, streamed. A damaged or truncated
    compressed stream raises ValueError naming the file and the line it broke at."""
    import zstandard

    name = str(path)
    n = 0
    try:
        if name.endswith(".gz"):
            stream: Any = gzip.open(path, "rb")
        elif name.endswith(".zst"):
            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115
            stream = io.BufferedReader(raw)
        else:
            stream = open(path, "rb")  # noqa: SIM115
        with stream:
            for n, line in enumerate(stream, 1):
                yield n, line
    except (OSError, EOFError, zstandard.ZstdError) as e:
        kind = "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else "JSON-lines"
        at = f"after line {n}" if n else "at its start"
        raise ValueError(f"{path}: not a readable {kind} file {at}: {e}") from e


class Jsonl(Format):
    """One document per line (``text_field`` or ``template``); plain files in byte ranges, compressed ones whole
    (a compressed stream cannot be entered mid-way)."""

    name = "jsonl"
    suffixes = (".jsonl", ".jsonl.gz", ".jsonl.zst")

    def units(self, path: Path, shard_bytes: int) -> list[tuple[int, int]]:
        return byte_ranges(path, shard_bytes) if path.name.endswith(".jsonl") else [(0, -1)]

    def records(self, unit: Unit, src: Any) -> Iterator[str | Bad]:
        path = unit.path
        if unit.end == -1:
            numbered = numbered_lines(path)
            where = lambda n: f"{path}:{n}"  # noqa: E731
        else:
            numbered = lines(path, unit.start, unit.end)
            where = lambda off: f"{path}:{line_number(path, off)}"  # noqa: E731
        for n, rec in json_lines(numbered):
            doc = rec if isinstance(rec, Bad) else from_record(rec, src)
            if isinstance(doc, Bad):
                doc.where = where(n)
            yield doc

    def text_bytes(self, path: Path, enough: int) -> int:
        """A compressed file's text, counted by decompressing it until ``enough`` bytes are certain."""
        if path.name.endswith(".jsonl"):
            return path.stat().st_size
        size = 0
        try:
            for _, line in numbered_lines(path):
                size += len(line)
                if size >= enough:
                    break
        except ValueError:  # damaged: check_sample names it; make no claim here
            return max(size, enough)
        return size

    def check_sample(self, src: Any, key: str, path: Path) -> list[str]:
        """The first record (plain or compressed alike) parses and holds the source's field(s)."""
        return first_record(path, key, lambda rec: _field_problem(rec, src))


def _field_problem(rec: Any, src: Any) -> str | None:
    if not isinstance(rec, dict):
        return "record is not an object"
    if src.template is not None:
        missing = [f for f in template_fields(src.template) if f not in rec]
        return f"no field {missing[0]!r} for template {src.template!r}" if missing else None
    return None if isinstance(rec.get(src.text_field), str) else f"no string field {src.text_field!r}"


def first_record(path: Path, key: str, problem: Callable[[Any], str | None]) -> list[str]:
    """Pre-flight of a JSON-lines file (.jsonl, .jsonl.gz, .jsonl.zst): its first record parses and
    ``problem(record)`` finds nothing wrong with it; [] when good, else one line naming file and line."""
    try:
        for n, rec in json_lines(numbered_lines(path)):
            why = rec.reason if isinstance(rec, Bad) else problem(rec)
            return [f"{key}: {path}:{n}: {why}"] if why else []
    except ValueError as e:  # a damaged compressed stream
        return [f"{key}: {e}"]
    return [f"{key}: {path}: no records"]
