"""A writer of megatron's indexed dataset format (``.bin`` + ``.idx``) with numpy only.

data_prep writes datasets that megatron's ``IndexedDataset`` reads at training time. megatron's own
``IndexedDatasetBuilder`` cannot be imported without the whole of ``megatron.core`` (its package
``__init__`` pulls in torch, tensor_parallel and transformer: about 9 s on 2 loaded cores, 2-3 s idle),
which was most of data_prep's start-up; this writer produces the same bytes (tests/engine/data/test_indexed.py checks
it against megatron's builder and reader) without importing either.

Format (version 1): ``.bin`` holds the tokens of every sequence back to back in ``dtype``; ``.idx`` holds
the header ``MMIDIDX\\0\\0``, version (u64 = 1), dtype code (u8), sequence count (u64), document count (u64,
number of entries of the document index), sequence lengths (int32), sequence byte offsets into ``.bin``
(int64), document index (int64: sequence numbers at which documents end, starting with 0).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}
CHUNK = 1 << 20
"""Bytes per block when indexes and token files are copied (the writer's memory does not grow with the data)."""


class IndexedWriter:
    """Write ``<prefix>.bin`` document by document (one sequence each), then ``finalize`` the ``.idx``.

    Memory stays bounded whatever the dataset's size: tokens go straight to ``.bin``, the sequence lengths and
    document ends to two unnamed temporary files next to it (nothing is left behind by a crash), and
    :meth:`add_index` and :meth:`finalize` copy in blocks of ``chunk`` bytes.
    """

    def __init__(self, bin_path: str | Path, dtype: Any, chunk: int = CHUNK) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.name not in DTYPE_CODES:
            raise ValueError(f"indexed dataset dtype {self.dtype}: expected one of {sorted(DTYPE_CODES)}")
        self.chunk = max(8, chunk - chunk % 8)
        self.data = open(bin_path, "wb")  # noqa: SIM115 (closed by finalize)
        folder = Path(bin_path).parent
        self._lengths = tempfile.TemporaryFile(dir=folder)  # int64 per sequence
        self._ends = tempfile.TemporaryFile(dir=folder)  # int64 per document: sequences written so far
        self.sequences = 0
        self.documents = 1  # entries of the document index (it starts with 0)

    def add_document(self, ids: Any) -> None:
        """Append one document of token ids as one sequence."""
        array = np.asarray(ids, dtype=self.dtype)
        self.data.write(array.tobytes(order="C"))
        self.sequences += 1
        self._lengths.write(struct.pack("<q", array.size))
        self._ends.write(struct.pack("<q", self.sequences))
        self.documents += 1

    def add_index(self, prefix: str | Path) -> None:
        """Append every document of the dataset ``prefix``.bin/.idx (same dtype)."""
        with open(f"{prefix}.idx", "rb") as f:
            dtype, sequences, documents = _header(f, f"{prefix}.idx")
            if dtype != self.dtype:
                raise ValueError(f"{prefix}.idx: dtype {dtype}, this dataset is {self.dtype}")
            for block in _blocks(f, np.int32, sequences, self.chunk, f"{prefix}.idx"):
                self._lengths.write(block.astype("<i8").tobytes())
            f.seek(8 * sequences, os.SEEK_CUR)  # the shard's byte offsets: recomputed by finalize
            first = True
            for block in _blocks(f, np.int64, documents, self.chunk, f"{prefix}.idx"):
                block = block[1:] if first else block  # every document index starts with 0
                first = False
                self._ends.write((block + self.sequences).astype("<i8").tobytes())
        self.sequences += sequences
        self.documents += max(documents - 1, 0)
        with open(f"{prefix}.bin", "rb") as f:
            shutil.copyfileobj(f, self.data, self.chunk)

    def finalize(self, idx_path: str | Path) -> None:
        """Close ``.bin`` and write the index: header, lengths (int32), byte offsets (int64), document ends."""
        self.data.close()
        with open(idx_path, "wb") as f:
            f.write(HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[self.dtype.name]))
            f.write(struct.pack("<Q", self.sequences) + struct.pack("<Q", self.documents))
            self._lengths.seek(0)
            for block in _blocks(self._lengths, np.int64, self.sequences, self.chunk):
                f.write(block.astype("<i4").tobytes())
            self._lengths.seek(0)
            offset = 0
            for block in _blocks(self._lengths, np.int64, self.sequences, self.chunk):
                nbytes = block * self.dtype.itemsize
                ends = np.cumsum(nbytes) + offset
                f.write((ends - nbytes).astype("<i8").tobytes())
                offset = int(ends[-1])
            f.write(struct.pack("<q", 0))
            self._ends.seek(0)
            shutil.copyfileobj(self._ends, f, self.chunk)
        self._lengths.close()
        self._ends.close()


def _header(f: BinaryIO, name: str) -> tuple[np.dtype, int, int]:
    """(dtype, sequence count, document-index entries) from the start of an open ``.idx``."""
    head = f.read(34)
    if len(head) < 34 or head[:9] != HEADER or struct.unpack_from("<Q", head, 9)[0] != 1:
        raise ValueError(f"{name}: not a version-1 megatron indexed dataset index")
    code = head[17]
    names = {c: n for n, c in DTYPE_CODES.items()}
    if code not in names:
        raise ValueError(f"{name}: unknown dtype code {code}")
    sequences, documents = struct.unpack_from("<QQ", head, 18)
    return np.dtype(names[code]), int(sequences), int(documents)


def _blocks(f: BinaryIO, dtype: Any, count: int, chunk: int, name: str = "spool") -> Iterator[np.ndarray]:
    """``count`` little-endian items of ``dtype`` read from ``f``'s position on, at most ``chunk`` bytes at a
    time (``name``: the file, for the error)."""
    size = np.dtype(dtype).itemsize
    per = max(1, chunk // size)
    while count > 0:
        n = min(per, count)
        raw = f.read(n * size)
        if len(raw) < n * size:
            raise ValueError(f"{name}: truncated")
        yield np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
        count -= n


def read_index(idx_path: str | Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """``(dtype, sequence lengths, document index)`` of an ``.idx`` file; ValueError naming it if malformed."""
    with open(idx_path, "rb") as f:
        dtype, sequences, documents = _header(f, str(idx_path))
        lengths = np.fromfile(f, dtype="<i4", count=sequences)
        f.seek(8 * sequences, os.SEEK_CUR)
        doc_index = np.fromfile(f, dtype="<i8", count=documents)
    if len(lengths) < sequences or len(doc_index) < documents:
        raise ValueError(f"{idx_path}: truncated")
    return dtype, lengths, doc_index


def documents(prefix: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, offsets)`` of dataset ``prefix`` written one sequence per document (as ``IndexedWriter``
    does): document ``j`` is ``tokens[offsets[j]:offsets[j + 1]]`` (``tokens`` memory-mapped)."""
    dtype, lengths, _ = read_index(f"{prefix}.idx")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not offsets[-1]:
        return np.zeros(0, dtype=dtype), offsets
    return np.memmap(f"{prefix}.bin", dtype=dtype, mode="r"), offsets
