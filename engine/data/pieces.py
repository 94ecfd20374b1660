"""Bounded tokenizer calls: a long document is encoded in pieces, documents go to the tokenizer in batches
bounded in characters as well as in count, so memory follows these bounds, not the size of any document.

A Hugging Face tokenizer's call costs about 40 bytes per character of its batch while it runs (measured in
docs/benchmarks.md: a single 5 MB document took 1.8 GB), so without bounds one long line is enough to run a
node out of memory. A piece ends just before a space that follows a non-space character: byte-level BPE
pre-tokenizers (GPT-2's, Llama 3's and Qwen's split patterns, and the pipeline's own BPE) split there anyway,
so no merge crosses the cut and the ids are exactly those of the whole document. Only a stretch of
``PIECE_CHARS`` characters without such a space is cut where the bound falls (there the ids around the cut
can differ from the whole document's), and tokenizers that add something to every input they get (a
SentencePiece-style ``Prepend`` normalizer, as in Llama 2's tokenizer.json) add it once per piece.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

PIECE_CHARS = 1 << 16
"""Longest text given to the tokenizer in one piece (longer documents are cut, see the module docstring)."""
BATCH_CHARS = 1 << 18
"""Most characters per tokenizer call (a batch of documents or pieces)."""
BATCH_DOCS = 512
"""Most documents (or pieces) per tokenizer call."""


def text_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """``text`` as consecutive pieces of at most ``limit`` characters (one piece when it is that short)."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > limit:
        cut = _cut(text, start, start + limit)
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _cut(text: str, start: int, end: int) -> int:
    """End of the piece starting at ``start`` (``start < cut <= end``): before the last space in reach that
    follows a non-space character, else ``end``."""
    i = text.rfind(" ", start + 1, end + 1)
    while i > start:
        if not text[i - 1].isspace():
            return i
        i = text.rfind(" ", start + 1, i)
    return end


def bounded_batches(
    items: Iterable[T], chars: Callable[[T], int], max_items: int = BATCH_DOCS, max_chars: int = BATCH_CHARS
) -> Iterator[list[T]]:
    """``items`` in order, in lists of at most ``max_items`` that end once they hold ``max_chars`` characters."""
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += chars(item)
        if len(batch) >= max_items or size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
