"""JSON lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and the project's one JSON-lines parser.

:func:`json_lines` parses every JSON-lines input (pretraining sources, corpus=files, users' chat data, the
generated task files); callers decide whether a bad line fails or is counted.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.data.formats.base import Bad, Format, Unit, byte_ranges, from_record, line_number, lines


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
    """(line number, line) of a JSON-lines file, plain or .gz/.zst, streamed."""
    name = str(path)
    if name.endswith(".gz"):
        stream: Any = gzip.open(path, "rb")
    elif name.endswith(".zst"):
        import zstandard

        stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    else:
        stream = open(path, "rb")
    with stream:
        yield from enumerate(stream, 1)


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

    def check_sample(self, src: Any, key: str, path: Path) -> list[str]:
        for n, rec in json_lines(numbered_lines(path)):
            if isinstance(rec, Bad):
                return [f"{key}: {path}:{n}: {rec.reason}"]
            if src.template is None and not isinstance(from_record(rec, src), str):
                return [f"{key}: {path}:{n}: no string field {src.text_field!r}"]
            return []
        return [f"{key}: {path}: no records"]
