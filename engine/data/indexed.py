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

import shutil
import struct
from pathlib import Path
from typing import Any

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


class IndexedWriter:
    """Write ``<prefix>.bin`` document by document (one sequence each), then ``finalize`` the ``.idx``."""

    def __init__(self, bin_path: str | Path, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.name not in DTYPE_CODES:
            raise ValueError(f"indexed dataset dtype {self.dtype}: expected one of {sorted(DTYPE_CODES)}")
        self.data = open(bin_path, "wb")  # noqa: SIM115 (closed by finalize)
        self.lengths: list[int] = []
        self.documents: list[int] = [0]

    def add_document(self, ids: Any) -> None:
        """Append one document of token ids as one sequence."""
        array = np.asarray(ids, dtype=self.dtype)
        self.data.write(array.tobytes(order="C"))
        self.lengths.append(int(array.size))
        self.documents.append(len(self.lengths))

    def add_index(self, prefix: str | Path) -> None:
        """Append every document of the dataset ``prefix``.bin/.idx (same dtype)."""
        dtype, lengths, documents = read_index(f"{prefix}.idx")
        if dtype != self.dtype:
            raise ValueError(f"{prefix}.idx: dtype {dtype}, this dataset is {self.dtype}")
        offset = len(self.lengths)
        self.lengths.extend(int(n) for n in lengths)
        self.documents.extend(int(d) + offset for d in documents[1:])
        with open(f"{prefix}.bin", "rb") as f:
            shutil.copyfileobj(f, self.data)

    def finalize(self, idx_path: str | Path) -> None:
        """Close ``.bin`` and write the index."""
        self.data.close()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[self.dtype.name]))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(self.documents)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.documents, dtype=np.int64).tobytes(order="C"))


def read_index(idx_path: str | Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """``(dtype, sequence lengths, document index)`` of an ``.idx`` file; ValueError naming it if malformed."""
    raw = Path(idx_path).read_bytes()
    if raw[:9] != HEADER or struct.unpack_from("<Q", raw, 9)[0] != 1:
        raise ValueError(f"{idx_path}: not a version-1 megatron indexed dataset index")
    code = raw[17]
    names = {c: n for n, c in DTYPE_CODES.items()}
    if code not in names:
        raise ValueError(f"{idx_path}: unknown dtype code {code}")
    sequences, documents = struct.unpack_from("<QQ", raw, 18)
    offset = 34
    lengths = np.frombuffer(raw, dtype=np.int32, count=sequences, offset=offset)
    offset += 4 * sequences + 8 * sequences
    doc_index = np.frombuffer(raw, dtype=np.int64, count=documents, offset=offset)
    return np.dtype(names[code]), lengths, doc_index


def documents(prefix: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, offsets)`` of dataset ``prefix`` written one sequence per document (as ``IndexedWriter``
    does): document ``j`` is ``tokens[offsets[j]:offsets[j + 1]]`` (``tokens`` memory-mapped)."""
    dtype, lengths, _ = read_index(f"{prefix}.idx")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not offsets[-1]:
        return np.zeros(0, dtype=dtype), offsets
    return np.memmap(f"{prefix}.bin", dtype=dtype, mode="r"), offsets
