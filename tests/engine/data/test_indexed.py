"""engine.data.indexed writes the same bytes as megatron's IndexedDatasetBuilder (documents and merged shards)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.data.indexed import IndexedWriter, read_index


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_same_bytes_as_megatron(tmp_path: Path, dtype: type) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    shards = [[rng.integers(0, 500, rng.integers(1, 30)).tolist() for _ in range(n)] for n in (7, 1, 5)]
    for who in ("ours", "megatron"):
        for k, docs in enumerate(shards):
            prefix = tmp_path / f"{who}{k}"
            if who == "ours":
                ours = IndexedWriter(f"{prefix}.bin", dtype)
                for ids in docs:
                    ours.add_document(ids)
                ours.finalize(f"{prefix}.idx")
            else:
                theirs = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
                for ids in docs:
                    theirs.add_item(torch.tensor(ids))
                    theirs.end_document()
                theirs.finalize(f"{prefix}.idx")
        merged = IndexedWriter(tmp_path / f"{who}.bin", dtype) if who == "ours" else None
        theirs = IndexedDatasetBuilder(str(tmp_path / f"{who}.bin"), dtype=dtype) if merged is None else None
        for k in range(len(shards)):
            (merged or theirs).add_index(str(tmp_path / f"{who}{k}"))  # type: ignore[union-attr]
        (merged or theirs).finalize(str(tmp_path / f"{who}.idx"))  # type: ignore[union-attr]
    for name in ("0", "1", "2", ""):
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"ours{name}{ext}").read_bytes() == (
                tmp_path / f"megatron{name}{ext}"
            ).read_bytes()
    docs = [d for shard in shards for d in shard]
    ds = IndexedDataset(str(tmp_path / "ours"))
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    got_dtype, lengths, _ = read_index(tmp_path / "ours.idx")
    assert got_dtype == np.dtype(dtype) and lengths.tolist() == [len(d) for d in docs]


def test_blockwise_copies_give_the_same_bytes_and_keep_no_lists(tmp_path: Path) -> None:
    """Blocks of 16 bytes (lengths, offsets and document ends cut mid-shard) and empty shards change no byte;
    the writer keeps counts, not per-document lists (its memory does not grow with the dataset)."""
    rng = np.random.default_rng(1)
    shards = [[rng.integers(0, 60000, rng.integers(0, 40)).tolist() for _ in range(n)] for n in (9, 0, 1, 13)]
    for chunk in (16, 1 << 20):
        for k, docs in enumerate(shards):
            w = IndexedWriter(tmp_path / f"c{chunk}-{k}.bin", np.uint16, chunk=chunk)
            for ids in docs:
                w.add_document(ids)
            w.finalize(tmp_path / f"c{chunk}-{k}.idx")
        merged = IndexedWriter(tmp_path / f"c{chunk}.bin", np.uint16, chunk=chunk)
        for k in range(len(shards)):
            merged.add_index(tmp_path / f"c{chunk}-{k}")
        merged.add_document([7, 8])
        assert not any(isinstance(v, list) for v in vars(merged).values())
        merged.finalize(tmp_path / f"c{chunk}.idx")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"c16{ext}").read_bytes() == (tmp_path / f"c1048576{ext}").read_bytes()
    docs = [d for shard in shards for d in shard] + [[7, 8]]
    _, lengths, doc_index = read_index(tmp_path / "c16.idx")
    assert lengths.tolist() == [len(d) for d in docs] and doc_index.tolist() == list(range(len(docs) + 1))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("c")) == []  # no spool left


def test_a_truncated_index_is_named(tmp_path: Path) -> None:
    w = IndexedWriter(tmp_path / "a.bin", np.uint16)
    for n in range(50):
        w.add_document(list(range(n)))
    w.finalize(tmp_path / "a.idx")
    raw = (tmp_path / "a.idx").read_bytes()
    (tmp_path / "a.idx").write_bytes(raw[:-40])
    with pytest.raises(ValueError, match="a.idx: truncated"):
        IndexedWriter(tmp_path / "b.bin", np.uint16).add_index(tmp_path / "a")
    with pytest.raises(ValueError, match="a.idx: truncated"):
        read_index(tmp_path / "a.idx")
