"""Checksums of checkpoint files and their verification against the marker (one process, or shared by ranks).

Each file's marker entry records its size, a whole-file checksum (``HASH``) and the checksums of up to
``_SAMPLES`` sampled blocks; ``VERIFY_MODES`` say how much of that a check reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from engine.checkpoint.collective import gathered, on_rank0
from engine.checkpoint.errors import CheckpointError
from engine.checkpoint.layout import ITER_DIR, MARKER, files, owner, read_marker
from engine.runtime.distributed import rank as _rank
from engine.runtime.distributed import world_size as _world

_HASH_BLOCK = 4 << 20
_SAMPLES = 8
"""Blocks per file whose hashes the marker records for ``sampled`` verification."""
VERIFY_MODES = ("full", "sampled", "sizes")
"""``full``: every byte against the whole-file checksum (the default); ``sampled``: sizes plus up to
``_SAMPLES`` blocks per file; ``sizes``: sizes only."""
HASH = "xxh3_128"
"""The checksum new markers record per file (and per sampled block): xxHash3-128, non-cryptographic, made to
catch corruption (torn or truncated writes, flipped bits, a file from another save) at ~7x the speed of
sha256 on these CPUs (``bench/bench_verify.py`` prints both), so a full verification stays a small part of a
load. Markers that record ``sha256`` (written before) verify with sha256."""
HASHES = ("xxh3_128", "sha256")
_VERIFY_MODE = "full"
_VERIFY_THREADS = 4


# ---------------------------------------------------------------------------- checksums


def _sample_blocks(size: int) -> list[int]:
    """Indices of the ``_HASH_BLOCK``-sized blocks the ``sampled`` verification reads: evenly spread,
    first and last included, at most ``_SAMPLES`` of them."""
    count = -(-size // _HASH_BLOCK)
    if count <= _SAMPLES:
        return list(range(count))
    return sorted({round(i * (count - 1) / (_SAMPLES - 1)) for i in range(_SAMPLES)})


def _hasher(algo: str) -> Any:
    """A fresh hash object of ``algo`` (one of ``HASHES``)."""
    if algo == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def _record_hash(record: dict[str, Any]) -> str | None:
    """The checksum algorithm a marker entry records (None: none known)."""
    return next((algo for algo in HASHES if algo in record), None)


def file_record(path: Path, *, fsync: bool = False, samples: bool = True, algo: str = HASH) -> dict[str, Any]:
    """``{"size", <algo>, "blocks"}`` of a file, read once; with ``fsync`` its data is flushed first.

    ``blocks`` maps the sampled block indices (``_sample_blocks``) to their own checksum, for the cheaper
    ``sampled`` verification; ``<algo>`` is the whole file's and is what ``full`` verification checks.
    """
    if not (fsync or samples):
        return _mapped_record(path, algo)
    digest, size, index = _hasher(algo), 0, 0
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        wanted = set(_sample_blocks(os.fstat(f.fileno()).st_size)) if samples else set()
        blocks = {}
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            if index in wanted:
                h = _hasher(algo)
                h.update(block)
                blocks[str(index)] = h.hexdigest()
            size += len(block)
            index += 1
    return {"size": size, algo: digest.hexdigest(), "blocks": blocks}


def _mapped_record(path: Path, algo: str) -> dict[str, Any]:
    """``{"size", <algo>}`` of a file, hashed from a read-only memory map: the hash reads the page cache
    directly, with no copy into a buffer (about 1.8x faster than reading blocks here)."""
    import mmap

    digest = _hasher(algo)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                mapped.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(mapped)
                try:
                    digest.update(view)
                finally:
                    view.release()
    return {"size": size, algo: digest.hexdigest(), "blocks": {}}


def record_own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """fsync and checksum the files this rank wrote (relative POSIX path -> record)."""
    return {
        p.relative_to(directory).as_posix(): file_record(p, fsync=True)
        for p in files(directory)
        if owner(p.name) == rank
    }


# ---------------------------------------------------------------------------- verification


def set_verify_mode(mode: str) -> None:
    """How ``find_latest`` checks file contents from now on in this process (``VERIFY_MODES``)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"checkpoint verify mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
    global _VERIFY_MODE
    _VERIFY_MODE = mode


def verify_mode() -> str:
    """The process's verify mode (``set_verify_mode``; ``full`` unless changed)."""
    return _VERIFY_MODE


def verify(path: Path, *, checksums: bool = True, mode: str | None = None) -> list[str]:
    """Problems of checkpoint ``path``, each naming the file and what failed; empty when it is good.

    Good: the marker is present and readable, its iteration matches the directory name, and every file
    it lists is present with the recorded size and (``mode``, default ``full``; ``checksums=False`` means
    ``sizes``) content. Files the marker does not list are ignored. One process checks every file; ranks
    of a job share the work with ``verify_collective``.
    """
    mode = mode or ("full" if checksums else "sizes")
    meta, problems = marker_check(Path(path))
    if meta is None:
        return problems
    return problems + _check_files(Path(path), sorted(meta["files"].items()), mode)


def marker_check(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The marker of ``path`` (None when unusable) and the problems found in it."""
    if not path.is_dir():
        return None, [f"{path}: not a directory"]
    try:
        meta = read_marker(path)
    except CheckpointError as e:
        return None, [str(e)]
    m = ITER_DIR.match(path.name)
    if m and int(m.group(1)) != meta.get("iteration"):
        return meta, [f"{path / MARKER}: iteration {meta.get('iteration')} does not match the name"]
    return meta, []


def share(files: dict[str, Any], rank: int, world: int) -> list[tuple[str, Any]]:
    """The marker entries rank ``rank`` of ``world`` verifies: the files rank ``r`` wrote go to rank
    ``r % world`` (the rank that reads them back when the layout is unchanged); shared files to rank 0."""
    return [(rel, rec) for rel, rec in sorted(files.items()) if owner(Path(rel).name) % world == rank]


def _check_files(directory: Path, entries: list[tuple[str, Any]], mode: str) -> list[str]:
    """Problems of the listed files, hashed by up to ``_VERIFY_THREADS`` threads (hashlib frees the GIL)."""
    if len(entries) <= 1 or mode == "sizes":
        return [p for rel, rec in entries for p in _check_file(directory / rel, rec, mode)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(_VERIFY_THREADS, len(entries))) as pool:
        found = pool.map(lambda e: _check_file(directory / e[0], e[1], mode), entries)
        return [p for problems in found for p in problems]


def _check_file(path: Path, record: Any, checksums: bool | str) -> list[str]:
    mode = checksums if isinstance(checksums, str) else ("full" if checksums else "sizes")
    algo = _record_hash(record) if isinstance(record, dict) else None
    if not isinstance(record, dict) or "size" not in record or algo is None:
        return [f"{path}: the marker's entry {record!r} lacks size and a checksum ({'/'.join(HASHES)})"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{path}: missing"]
    if size != record["size"]:
        return [f"{path}: size {size} bytes, the marker records {record['size']}"]
    if mode == "full":
        digest = file_record(path, samples=False, algo=algo)[algo]
        if digest != record[algo]:
            return [f"{path}: {algo} {digest[:16]} differs from the marker's {record[algo][:16]}"]
    elif mode == "sampled":
        return _check_samples(path, record, algo)
    return []


def _check_samples(path: Path, record: dict[str, Any], algo: str) -> list[str]:
    blocks = record.get("blocks")
    if not isinstance(blocks, dict):
        return _check_file(path, record, "full")  # a marker from before sampled hashes: check it all
    with open(path, "rb") as f:
        for index, expected in sorted(blocks.items(), key=lambda kv: int(kv[0])):
            f.seek(int(index) * _HASH_BLOCK)
            h = _hasher(algo)
            h.update(f.read(_HASH_BLOCK))
            if h.hexdigest() != expected:
                return [f"{path}: block {index} ({_HASH_BLOCK} bytes) differs from the marker's {algo}"]
    return []


def verify_collective(path: Path, mode: str | None = None) -> list[str]:
    """``verify`` shared by every rank; collective (call it on all ranks), same answer on every rank.

    Rank 0 reads the marker and sends its file table; each rank checks its ``share`` (the files it wrote
    or will read) in parallel with the others; the problems of all ranks are gathered on every rank.
    """
    mode = mode or _VERIFY_MODE
    if _world() == 1:
        return verify(path, mode=mode)
    path = Path(path)
    meta, problems = on_rank0(lambda: marker_check(path), f"reading the marker of {path}")
    mine = check_share(path, share(meta["files"], _rank(), _world()), mode) if meta is not None else []
    return problems + gathered(mine)


def check_share(path: Path, entries: list[tuple[str, Any]], mode: str) -> list[str]:
    """``_check_files``, with a failed read reported as a problem of this rank."""
    try:
        return _check_files(path, entries, mode)
    except OSError as e:
        return [f"rank {_rank()}: reading {path} failed: {e}"]
