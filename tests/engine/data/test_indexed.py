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
