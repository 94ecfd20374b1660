"""Arrow-backed formats: Parquet files (one unit per row group) and ``datasets`` save_to_disk folders (``hf``:
one unit per Arrow file, its ``train`` split for a DatasetDict), read batch by batch with pyarrow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.data.formats.base import Bad, Format, Unit, columns, from_record


def batch_records(
    batches: Any, cols: list[str], names: set[str], src: Any, label: str, row0: int
) -> Iterator[str | Bad]:
    """The documents of Arrow record batches (rows numbered from ``row0`` + 1)."""
    missing = [c for c in cols if c not in names]
    row = row0
    for batch in batches:
        table = batch.to_pydict()
        for j in range(batch.num_rows):
            row += 1
            if missing:
                yield Bad(f"{label} {row}", f"no field {missing[0]!r}")
                continue
            doc = from_record({c: table[c][j] for c in cols}, src)
            if isinstance(doc, Bad):
                doc.where = f"{label} {row}"
            yield doc


class Parquet(Format):
    name = "parquet"
    suffixes = (".parquet",)

    def units(self, path: Path, shard_bytes: int) -> list[tuple[int, int]]:
        import pyarrow.parquet as pq

        return [(g, g + 1) for g in range(pq.ParquetFile(path).num_row_groups)]

    def records(self, unit: Unit, src: Any) -> Iterator[str | Bad]:
        import pyarrow.parquet as pq

        cols = columns(src)
        pf = pq.ParquetFile(unit.path)
        names = set(pf.schema_arrow.names)
        row0 = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
        batches = pf.iter_batches(
            batch_size=1024, row_groups=[unit.start], columns=[c for c in cols if c in names]
        )
        yield from batch_records(batches, cols, names, src, f"{unit.path} row", row0)

    def text_bytes(self, path: Path, enough: int) -> int:
        """The row groups' uncompressed size (from the file's metadata)."""
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception:  # damaged: check_sample names it; make no claim here
            return enough
        return sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))

    def check_sample(self, src: Any, key: str, path: Path) -> list[str]:
        import pyarrow.parquet as pq

        try:
            names = set(pq.ParquetFile(path).schema_arrow.names)
        except Exception as e:  # pyarrow raises several types for a damaged file
            return [f"{key}: {path}: not a readable Parquet file: {e}"]
        return _missing_columns(src, key, path, names)


def _missing_columns(src: Any, key: str, path: Path, names: set[str] | list[str]) -> list[str]:
    missing = [c for c in columns(src) if c not in names]
    return [f"{key}: {path}: no column {missing[0]!r} (columns: {sorted(names)})"] if missing else []


def _hf_dir(path: Path) -> Path:
    """A save_to_disk folder: the folder itself, or its ``train`` split for a DatasetDict."""
    if (path / "dataset_dict.json").is_file():
        return path / "train"
    return path


class Hf(Format):
    name = "hf"

    def detect(self, path: str) -> bool:
        p = Path(path)
        return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())

    def files(self, src: Any, key: str) -> list[Path]:
        d = _hf_dir(Path(src.path))
        state = d / "state.json"
        if not state.is_file():
            raise ValueError(f"{key}.path={src.path!r}: not a datasets save_to_disk folder (no state.json)")
        files = [d / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        return files or sorted(d.glob("*.arrow"))

    def records(self, unit: Unit, src: Any) -> Iterator[str | Bad]:
        import pyarrow as pa

        cols = columns(src)
        with pa.memory_map(unit.path, "r") as f:
            try:
                reader: Any = pa.ipc.open_stream(f)
                batches = iter(reader)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(f)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from batch_records(batches, cols, set(reader.schema.names), src, f"{unit.path} row", 0)
