"""Delimiter-separated values: ``.csv`` (comma) and ``.tsv`` (tab), read with Python's csv module.

The first row is the header (column names); each further row is one record, its document chosen by
``text_field`` (a column) or ``template`` (str.format over the columns; an empty cell is a null, so a
template over it makes the row malformed). One unit per file: a quoted field may span lines, so a file cannot
be entered mid-way. A row with the wrong column count, a missing column or
undecodable bytes is malformed (``data.bad_records``).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.data.formats.base import Bad, Format, Unit, columns, from_record

FIELD_LIMIT = 2**31 - 1
"""Largest field the csv module accepts here (its default, 128 KiB, is smaller than many documents)."""


def _decodable(row: list[str]) -> bool:
    """False when a field holds bytes that were not UTF-8 (read as surrogate escapes)."""
    try:
        for value in row:
            value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Csv(Format):
    name = "csv"
    suffixes = (".csv", ".tsv")

    def records(self, unit: Unit, src: Any) -> Iterator[str | Bad]:
        csv.field_size_limit(FIELD_LIMIT)
        delimiter = _delimiter(unit.path)
        with open(unit.path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = next(reader, None)
            if header is None:
                return
            missing = [c for c in columns(src) if c not in header]
            while True:
                where = f"{unit.path}:{reader.line_num + 1}"
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    yield Bad(where, f"not valid CSV: {e}")
                    continue
                if row:  # blank lines carry no record
                    yield _row_document(row, header, missing, src, where, delimiter)

    def check_sample(self, src: Any, key: str, path: Path) -> list[str]:
        try:
            with open(path, encoding="utf-8", newline="") as f:
                header = next(csv.reader(f, delimiter=_delimiter(str(path))), None)
        except (UnicodeDecodeError, csv.Error) as e:
            return [f"{key}: {path}:1: not a readable CSV header: {e}"]
        if header is None:
            return [f"{key}: {path}: no header row"]
        missing = [c for c in columns(src) if c not in header]
        return [f"{key}: {path}: no column {missing[0]!r} (columns: {sorted(header)})"] if missing else []


def _delimiter(path: str) -> str:
    return "\t" if path.endswith(".tsv") else ","


def _row_document(
    row: list[str], header: list[str], missing: list[str], src: Any, where: str, delimiter: str
) -> str | Bad:
    if len(row) != len(header):
        excerpt = delimiter.join(row).encode("utf-8", "replace").decode()
        return Bad(where, f"{len(row)} columns, the header has {len(header)}", excerpt)
    if not _decodable(row):
        return Bad(where, "undecodable UTF-8")
    if missing:
        return Bad(where, f"no field {missing[0]!r}")
    rec: dict[str, str | None] = dict(zip(header, row))
    if src.template:  # CSV has no null: an empty cell is one (as pandas and pyarrow read it)
        rec = {k: v if v != "" else None for k, v in rec.items()}
    doc = from_record(rec, src)
    if isinstance(doc, Bad):
        doc.where = where
    return doc
