"""An existing megatron indexed dataset (``<prefix>.bin/.idx``): never re-tokenized, it joins the training blend
as is (so it has no units and no records).

Its token ids mean the tokens of the tokenizer that made it: :func:`prefix_tokenizer` finds that tokenizer
(the source's ``tokenizer``, else the manifest of the data_prep output the prefix belongs to), and
:func:`max_token_id` reads the largest id, for a prefix whose tokenizer nobody names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.data.formats.base import Format

SCAN_TOKENS = 1 << 24
"""Token ids read per block by :func:`max_token_id` (memory-mapped; 32 MB of uint16)."""


class Megatron(Format):
    name = "megatron"
    tokenized = True

    def detect(self, path: str) -> bool:
        return Path(path + ".bin").is_file() and Path(path + ".idx").is_file()

    def files(self, src: Any, key: str) -> list[Path]:
        if not self.detect(src.path):
            raise ValueError(f"{key}.path={src.path!r}: no {src.path}.bin/.idx")
        return []


def prefix_tokenizer(src: Any) -> tuple[str, str] | None:
    """``(tokenizer path, how it is known)`` of a megatron prefix: the source's ``tokenizer``, else the
    tokenizer.json of the data_prep output whose manifest lists ``<prefix>.bin``; None when unknown."""
    if src.tokenizer:
        return str(src.tokenizer), "the source's tokenizer"
    prefix = Path(src.path)
    manifest = prefix.parent / "manifest.json"
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    listed = meta.get("files") if isinstance(meta, dict) else None
    tok = prefix.parent / "tokenizer.json"
    if isinstance(listed, dict) and f"{prefix.name}.bin" in listed and tok.is_file():
        return str(tok), f"recorded in {manifest}"
    return None


def prefix_tokens(prefix: str | Path) -> tuple[int, int]:
    """``(documents, tokens)`` of an indexed dataset, from its index (no token is read)."""
    from engine.data.indexed import read_index

    _, lengths, doc_index = read_index(f"{prefix}.idx")
    return max(len(doc_index) - 1, 0), int(lengths.sum(dtype="int64"))


def max_token_id(prefix: str | Path) -> int:
    """The largest token id in ``<prefix>.bin`` (-1 when empty), read in blocks of :data:`SCAN_TOKENS`."""
    import numpy as np

    from engine.data.indexed import read_index

    dtype, _, _ = read_index(f"{prefix}.idx")
    path = Path(f"{prefix}.bin")
    if path.stat().st_size < dtype.itemsize:
        return -1
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return max(int(tokens[i : i + SCAN_TOKENS].max()) for i in range(0, len(tokens), SCAN_TOKENS))


def check_prefix(src: Any, key: str, run_tokenizer: str | None) -> str | None:
    """Why the megatron prefix ``src`` cannot join a run tokenizing with ``run_tokenizer``
    (``data.tokenizer_path``), naming the source and both tokenizers; None when its ids mean this run's tokens.

    Its tokenizer known (:func:`prefix_tokenizer`): the two vocabularies must agree id for id (up to the
    special tokens data prep appends). Unknown: at least no id may lie beyond the run's vocabulary."""
    from pipeline.schema.data_identity import vocab_difference, vocab_digest, vocabulary

    known = prefix_tokenizer(src)
    where = f"{key}.path={src.path!r}"
    if run_tokenizer is None:
        made = f", {known[0]} ({known[1]})" if known else ""
        fix = (
            f"data.tokenizer_path={known[0]}" if known else f"data.tokenizer_path (and {key}.tokenizer) to it"
        )
        return (
            f"{where}: a megatron prefix holds the token ids of the tokenizer that made it{made}; a tokenizer "
            f"trained by this run (data.tokenizer_path=None) would give them other meanings: set {fix}"
        )
    try:
        ours = vocabulary(run_tokenizer)
        theirs = vocabulary(known[0]) if known else None
    except ValueError as e:
        return f"{where}: {e}"
    mine = f"data.tokenizer_path={run_tokenizer} ({len(ours)} tokens, vocabulary {vocab_digest(ours)})"
    if theirs is not None and known is not None:
        diff = vocab_difference(theirs, ours)
        if diff is None:
            return None
        return (
            f"{where}: its token ids come from the tokenizer {known[0]} ({known[1]}; {len(theirs)} tokens, "
            f"vocabulary {vocab_digest(theirs)}), this run's is {mine}: {diff}; use one tokenizer for every source "
            f"(data.tokenizer_path={known[0]}) or give the prefix's text as a source instead"
        )
    top = max_token_id(src.path)
    if top > max(ours, default=-1):
        return (
            f"{where}: holds token id {top}, beyond the vocabulary of {mine}: it was made with another "
            f"tokenizer; name it with {key}.tokenizer, or give the prefix's text as a source instead"
        )
    return None
