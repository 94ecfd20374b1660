"""Checkpoints of a training stage: atomic save, verified load, resume policy, retention.

Layout of ``ckpt_root`` (a stage's ``checkpoints/``)::

    iter_0000100/                 committed: megatron dist_checkpointing files (torch_dist backend),
        COMPLETE.json             one RNG file per rank, and the marker listing every file (size, xxh3_128)
    tmp.iter_0000150.<nonce>/     a save in progress, or one that crashed: never read, never deleted here
    latest                        the name of the newest committed checkpoint, written last

``save`` is collective over all ranks and commits in this order: every rank writes into the temp
directory; each rank fsyncs and checksums the files it wrote; rank 0 gathers the checksums, writes
``COMPLETE.json``, renames the temp directory to ``iter_<7 digits>`` and then rewrites ``latest``.
A crash at any point leaves either the previous state or a complete checkpoint. Readers trust only
directories whose marker verifies (``verify``); ``find_latest`` skips and reports the rest.

The common state (iteration, scheduler, the trainer's ``state`` dict, the torch thread count) goes into
dist_checkpointing's common file and must be equal on every rank. RNG states differ per rank, so each
rank writes ``rng.rank<rank>.pt``; they are restored only when the parallel layout is unchanged.
megatron is imported lazily, so ``verify``/``find_latest`` stay cheap for callers that never train.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import re
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException

from engine.runtime.distributed import all_gather_object as _all_gather
from engine.runtime.distributed import broadcast_object as _broadcast
from engine.runtime.distributed import gather_object as _gather
from engine.runtime.distributed import rank as _rank
from engine.runtime.distributed import world_size as _world
from engine.runtime.fault_injection import FaultInjector
from pipeline.records.files import atomic_write_text as _write_atomic
from pipeline.records.files import fsync_dir as _fsync_dir

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
LATEST = "latest"
FORMAT_VERSION = 1

_COMMON_KEY = "checkpoint"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$|^rng\.rank(\d+)\.pt$")
_DISTOPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
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


WRITE_FAILURES: tuple[type[BaseException], ...] = (Exception, _CheckpointException)
"""What a failed write raises: torch's CheckpointException (a full disk in the writers) is a BaseException."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or loaded. The message names the path and what failed."""


def iter_dir_name(iteration: int) -> str:
    """``iter_0000100`` for iteration 100."""
    return f"iter_{iteration:07d}"


# ---------------------------------------------------------------------------- collectives


def _on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 only and hand its result to every rank; a failure raises on every rank."""
    result, error, exc = None, None, None
    if _rank() == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error, exc = f"{what} failed on rank 0: {type(e).__name__}: {e}", e
    result, error = _broadcast((result, error))
    if error:
        raise CheckpointError(error) from exc
    return result


# ---------------------------------------------------------------------------- files, hashes, atomic writes


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


def _file_record(
    path: Path, *, fsync: bool = False, samples: bool = True, algo: str = HASH
) -> dict[str, Any]:
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


def _owner(name: str) -> int:
    """The rank that writes a checkpoint file: ``__<rank>_<n>.distcp``, ``rng.rank<rank>.pt``, else 0."""
    m = _RANK_FILE.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _record_own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """fsync and checksum the files this rank wrote (relative POSIX path -> record)."""
    return {
        p.relative_to(directory).as_posix(): _file_record(p, fsync=True)
        for p in _files(directory)
        if _owner(p.name) == rank
    }


def _iter_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of every ``iter_<7 digits>`` directory, newest first."""
    found = []
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else ():
        m = _ITER_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _read_marker(path: Path) -> dict[str, Any]:
    """The parsed marker of checkpoint ``path``; raises CheckpointError naming the file and the fault."""
    marker = path / MARKER
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{marker}: missing (the save did not complete)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker}: unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{marker}: no 'files' table")
    return meta


# ---------------------------------------------------------------------------- verification and discovery


def set_verify_mode(mode: str) -> None:
    """How ``find_latest`` checks file contents from now on in this process (``VERIFY_MODES``)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"checkpoint verify mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
    global _VERIFY_MODE
    _VERIFY_MODE = mode


def verify(path: Path, *, checksums: bool = True, mode: str | None = None) -> list[str]:
    """Problems of checkpoint ``path``, each naming the file and what failed; empty when it is good.

    Good: the marker is present and readable, its iteration matches the directory name, and every file
    it lists is present with the recorded size and (``mode``, default ``full``; ``checksums=False`` means
    ``sizes``) content. Files the marker does not list are ignored. One process checks every file; ranks
    of a job share the work with ``verify_collective``.
    """
    mode = mode or ("full" if checksums else "sizes")
    meta, problems = _marker_check(Path(path))
    if meta is None:
        return problems
    return problems + _check_files(Path(path), sorted(meta["files"].items()), mode)


def _marker_check(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The marker of ``path`` (None when unusable) and the problems found in it."""
    if not path.is_dir():
        return None, [f"{path}: not a directory"]
    try:
        meta = _read_marker(path)
    except CheckpointError as e:
        return None, [str(e)]
    m = _ITER_DIR.match(path.name)
    if m and int(m.group(1)) != meta.get("iteration"):
        return meta, [f"{path / MARKER}: iteration {meta.get('iteration')} does not match the name"]
    return meta, []


def share(files: dict[str, Any], rank: int, world: int) -> list[tuple[str, Any]]:
    """The marker entries rank ``rank`` of ``world`` verifies: the files rank ``r`` wrote go to rank
    ``r % world`` (the rank that reads them back when the layout is unchanged); shared files to rank 0."""
    return [(rel, rec) for rel, rec in sorted(files.items()) if _owner(Path(rel).name) % world == rank]


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
        digest = _file_record(path, samples=False, algo=algo)[algo]
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
    meta, problems = _on_rank0(lambda: _marker_check(path), f"reading the marker of {path}")
    mine = _check_share(path, share(meta["files"], _rank(), _world()), mode) if meta is not None else []
    return problems + _gathered(mine)


def _check_share(path: Path, entries: list[tuple[str, Any]], mode: str) -> list[str]:
    """``_check_files``, with a failed read reported as a problem of this rank."""
    try:
        return _check_files(path, entries, mode)
    except OSError as e:
        return [f"rank {_rank()}: reading {path} failed: {e}"]


def _gathered(mine: list[str]) -> list[str]:
    """Every rank's problems, on every rank (collective)."""
    return [p for rank_problems in _all_gather(mine) for p in rank_problems]


class CorruptCheckpoint(CheckpointError):
    """Files of a checkpoint do not match its marker (``problems`` names each file and what failed); raised
    by ``load(verify=...)`` before any of its tensors reached the model or the optimizer."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(f"refusing to load {path}: " + "; ".join(problems))
        self.problems = problems


class _OverlappedCheck:
    """Verification of a checkpoint overlapped with its load; collective (every rank makes one).

    Made before the load starts: every file but the tensor files (``.distcp``: the marker, torch's
    ``.metadata``, megatron's common and metadata files, the RNG files; small) is checked now and the
    ranks agree (``CorruptCheckpoint`` if one is bad); the tensor files of this rank's ``share`` are hashed
    by a background thread (xxhash and hashlib free the GIL) while the load plans. ``gate`` is called where
    torch's reader starts reading tensor data: it waits for the thread and the ranks agree on the verdict;
    bad files raise there, so no tensor of a bad checkpoint is ever copied into the model. Hashing first
    also leaves the files in the page cache, so the reads that follow cost little more.
    """

    def __init__(self, path: Path, mode: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.path, self.problems, self.agreed = path, [], False
        meta, problems = _on_rank0(lambda: _marker_check(path), f"reading the marker of {path}")
        mine = share(meta["files"], _rank(), _world()) if meta is not None else []
        tensors = [e for e in mine if e[0].endswith(".distcp")]
        problems += _gathered(_check_share(path, [e for e in mine if not e[0].endswith(".distcp")], mode))
        if meta is None or problems:
            raise CorruptCheckpoint(path, problems)
        pool = ThreadPoolExecutor(1, thread_name_prefix="verify")
        self.future = pool.submit(_check_share, path, tensors, mode)
        pool.shutdown(wait=False)

    def gate(self) -> None:
        """Wait for this rank's hashes and agree with the other ranks (collective; once); raise when bad."""
        if not self.agreed:
            self.problems, self.agreed = _gathered(self.future.result()), True
        if self.problems:
            raise CorruptCheckpoint(self.path, self.problems)

    def wait(self) -> None:
        """Let this rank's hashing finish (a failed load leaves no thread reading)."""
        self.future.exception()


def _gated_reads(check: _OverlappedCheck | None) -> Any:
    """A context in which megatron's torch_dist loads call ``check.gate`` before reading tensor data."""
    import contextlib

    from megatron.core.dist_checkpointing.strategies import torch as strategy

    @contextlib.contextmanager
    def gated() -> Any:
        factory = strategy._get_filesystem_reader

        def reader(*args: Any, **kwargs: Any) -> Any:
            found = factory(*args, **kwargs)
            read = found.read_data

            def read_data(plan: Any, planner: Any) -> Any:
                check.gate()  # type: ignore[union-attr]
                return read(plan, planner)

            found.read_data = read_data
            return found

        strategy._get_filesystem_reader = reader
        try:
            yield
        finally:
            strategy._get_filesystem_reader = factory

    return gated() if check is not None else contextlib.nullcontext()


def find_latest(
    ckpt_root: Path, *, collective: bool = True, mode: str | None = None, below: int | None = None
) -> Path | None:
    """The newest checkpoint under ``ckpt_root`` that verifies, or None.

    Incomplete saves (temp directories, no marker) and corrupt checkpoints are logged as warnings, naming
    the file and the fault, and skipped; nothing is deleted. With ``collective`` and an initialized
    process group (call it on all ranks), every rank checks its share of each candidate's files
    (``verify_collective``) and all ranks get the same answer. ``mode``: ``VERIFY_MODES`` (default: the
    process's ``set_verify_mode``, ``full`` unless changed). ``below``: only iterations below it.
    """
    ckpt_root, mode = Path(ckpt_root), mode or _VERIFY_MODE
    if not (collective and _world() > 1):
        found = _find_latest_here(ckpt_root, mode, below)
        return Path(found) if found else None
    names = _on_rank0(lambda: _candidates(ckpt_root, below), f"listing {ckpt_root}")
    for name in names:
        path = ckpt_root / name
        problems = verify_collective(path, mode)
        if not problems:
            if _rank() == 0:
                _check_latest_pointer(ckpt_root, path)
            return path
        if _rank() == 0:
            log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def _candidates(ckpt_root: Path, below: int | None = None) -> list[str]:
    """Names of the committed-looking checkpoints (iterations below ``below``), newest first; warns about
    unfinished saves."""
    for tmp in sorted(ckpt_root.glob("tmp.iter_*")):
        log.warning("incomplete checkpoint %s: the save did not finish; ignored, kept for inspection", tmp)
    return [path.name for it, path in _iter_dirs(ckpt_root) if below is None or it < below]


def _find_latest_here(ckpt_root: Path, mode: str = "full", below: int | None = None) -> str | None:
    for name in _candidates(ckpt_root, below):
        path = ckpt_root / name
        problems = verify(path, mode=mode)
        if not problems:
            _check_latest_pointer(ckpt_root, path)
            return str(path)
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def _check_latest_pointer(ckpt_root: Path, found: Path) -> None:
    try:
        named = (ckpt_root / LATEST).read_text().strip()
    except OSError:
        named = None
    if named != found.name:
        log.warning("%s names %r but the newest verified checkpoint is %s", ckpt_root / LATEST, named, found)


# ---------------------------------------------------------------------------- save


def save(
    ckpt_root: Path,
    iteration: int,
    *,
    model_chunks: list,
    optimizer: Any,
    scheduler: Any,
    state: dict,
    keep_last: int = 2,
    async_save: bool = False,
    final: bool = False,
    keep_incomplete: int = 1,
    models: dict[str, tuple[list, Any, Any]] | None = None,
) -> Path:
    """Save a checkpoint of ``iteration`` under ``ckpt_root``; collective over all ranks.

    ``models``: other trained models of the unit (engine.train.units), name -> (chunks, optimizer,
    scheduler); each gets its own part (``<name>.model``, ``<name>.optimizer``, tensors keyed
    ``<name>.<param>``; its schedule in the common state's ``schedulers``).

    ``state`` holds the trainer's resumable values (``consumed_samples``, ...): plain values, equal on
    every rank. ``final=True`` marks the stage's last checkpoint, which retention always keeps besides the
    newest ``keep_last`` others; older ones are deleted (rank 0, after the commit). Returns the
    ``iter_<7 digits>`` path.

    With ``async_save`` (and not ``final``) the tensors are written by a forked process (megatron's
    AsyncCallsQueue; the fork sees the tensors as they were at this call) and the commit happens in
    ``finalize_async``, which every rank must call (each step; ``blocking=True`` before exiting). Until
    then the returned path does not exist. A save first completes any save still in flight.
    """
    from megatron.core import dist_checkpointing

    from engine.checkpoint import optim_fix

    finalize_async(blocking=True)
    ckpt_root = Path(ckpt_root)
    target = ckpt_root / iter_dir_name(iteration)
    common = _common_state(iteration, scheduler, state)
    common["schedulers"] = {
        n: sch.state_dict() for n, (_, _, sch) in (models or {}).items() if sch is not None
    }
    rng = _rng_state()
    tmp = Path(
        _on_rank0(lambda: str(_make_tmp_dir(ckpt_root, iteration)), f"creating a temp dir in {ckpt_root}")
    )
    optim_fix.apply()
    sharded = _sharded_state_dict(model_chunks, optimizer, is_loading=False, models=models)
    sharded[_COMMON_KEY] = common
    start = time.monotonic()
    is_async = async_save and not final
    _signal_safe_writer_queue()
    try:
        request = dist_checkpointing.save(sharded, str(tmp), async_sharded_save=is_async)
        torch.save(rng, tmp / f"rng.rank{_rank()}.pt")
        error = None
    except WRITE_FAILURES as e:  # a full disk: OSError, or torch's CheckpointException
        request, error = None, f"rank {_rank()}: writing {tmp} failed: {type(e).__name__}: {_first_line(e)}"
    errors = [x for x in _all_gather(error) if x]
    if errors:
        _discard(tmp)
        raise CheckpointError("; ".join(errors))
    info = {"iteration": iteration, "final": final, "world_size": _world(), "layout": _layout()}
    faults = FaultInjector(ckpt_root.parent, _rank())

    def commit() -> None:
        faults.check("ckpt_write", iteration)
        try:
            _commit(tmp, target, info, keep_last, faults, keep_incomplete)
        except CheckpointError:
            _discard(tmp)
            raise
        log.info("saved %s in %.2f s%s", target, time.monotonic() - start, " (async)" if is_async else "")

    if not is_async:
        commit()
        return target
    request.add_finalize_fn(commit)
    _async_queue().schedule_async_request(request)
    return target


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _discard(tmp: Path) -> None:
    """Rank 0 removes the temp dir of a save that failed, so it does not keep a full disk full."""
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("removed %s: the save failed", tmp)


def prune_incomplete(ckpt_root: Path, keep: int) -> list[Path]:
    """Delete the temp dirs of crashed saves except the newest ``keep`` (by iteration, then age); rank 0.

    Call only while no save of this stage is in flight (at resume, after a commit). Returns what it removed.
    """
    if _rank() != 0:
        return []
    found = []
    for p in Path(ckpt_root).glob("tmp.iter_*"):
        m = re.match(r"^tmp\.iter_(\d{7})\.", p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p.stat().st_mtime, p))
    removed = []
    for _, _, p in sorted(found, reverse=True)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
        log.warning("removed %s, the temp dir of a crashed save (keep_incomplete=%d)", p, keep)
        removed.append(p)
    return removed


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


_PR_SET_PDEATHSIG = 1
_FORK_STATE = {"parent": 0, "main_thread": False}


def _die_with_parent() -> None:
    """In a forked child: be SIGKILLed when the parent dies (Linux prctl), or exit now if it already did.

    The death signal fires when the *thread* that forked ends, so it is set only for forks made by the
    main thread (megatron's writers and our manager are), whose end is the process's end.
    """
    if not _FORK_STATE["main_thread"]:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing ties the helper to us
        return
    if os.getppid() != _FORK_STATE["parent"]:
        os._exit(1)  # the parent died between the fork and the prctl


def _before_fork() -> None:
    import threading

    _FORK_STATE.update(parent=os.getpid(), main_thread=threading.current_thread() is threading.main_thread())


def _tie_forks_to_this_process() -> None:
    """Every process forked from now on (the manager, megatron's async and per-bucket writers, their own
    forks) dies with its parent: a SIGKILLed rank or a watchdog exit leaves no writer behind."""
    global _FORKS_TIED
    if not _FORKS_TIED:
        os.register_at_fork(before=_before_fork, after_in_child=_die_with_parent)
        _FORKS_TIED = True


_FORKS_TIED = False


def _writer_helper_init() -> None:
    _ignore_stop_signals()
    _die_with_parent()


def _signal_safe_writer_queue() -> None:
    """Give dist_checkpointing's writer a results queue whose manager survives SLURM's warning signals.

    megatron 0.16-0.19 lazily starts a *spawned* multiprocessing manager for the writers' results (a
    fresh Python that imports torch: ~1.4 s at the first save, and a resource tracker besides). SLURM
    signals every process of a job step (``--signal``, scancel, preemption), the spawned manager dies of
    the default action, and the save that the signal asked for fails with BrokenPipeError. Ours is
    *forked* once per process (milliseconds, memory shared copy-on-write, no resource tracker), ignores
    SIGUSR1/SIGUSR2/TERM (the training process owns them), and dies with the training process
    (PR_SET_PDEATHSIG), as does every writer forked after it.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _tie_forks_to_this_process()
    if getattr(filesystem_async, "_results_queue", "missing") is not None:
        return  # already created (by us), or a megatron version without this global
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=_writer_helper_init)
    filesystem_async._results_queue = manager.Queue()
    global _MANAGER
    _MANAGER = manager


_MANAGER: Any = None
"""The manager behind dist_checkpointing's results queue (kept alive for the process's lifetime)."""

_QUEUE: Any = None
"""megatron's AsyncCallsQueue, created by the first async save."""


def _async_queue() -> Any:
    global _QUEUE
    if _QUEUE is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _QUEUE = AsyncCallsQueue()
    return _QUEUE


def finalize_async(blocking: bool = False) -> None:
    """Commit the async saves whose writes have finished on every rank; collective (every rank calls it).

    ``blocking=True`` waits for the writes. A no-op when no async save was made.
    """
    if _QUEUE is not None and _QUEUE.get_num_unfinalized_calls():
        _QUEUE.maybe_finalize_async_calls(blocking=blocking)


def pending_async() -> int:
    """Async saves made by this process and not yet committed (finalized)."""
    return int(_QUEUE.get_num_unfinalized_calls()) if _QUEUE is not None else 0


def _make_tmp_dir(ckpt_root: Path, iteration: int) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f"tmp.{iter_dir_name(iteration)}.{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _plain_state(state: dict) -> dict:
    """``state`` as given, after checking it holds plain values (they must load with weights_only)."""
    for key, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"state[{key!r}]: {e}; state holds plain values (numbers, strings, lists, dicts) equal on "
                "every rank (RNG states are saved per rank by checkpoint.save itself)"
            ) from None
    return dict(state)


def _common_state(iteration: int, scheduler: Any, state: dict) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "state": _plain_state(state),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "torch_threads": torch.get_num_threads(),
    }


def _commit(
    tmp: Path,
    target: Path,
    info: dict[str, Any],
    keep_last: int,
    faults: FaultInjector | None = None,
    keep_incomplete: int = 1,
) -> None:
    """Checksums from every rank -> marker -> rename -> ``latest`` -> retention (rank 0); collective."""
    try:
        own, error = _record_own_files(tmp, _rank()), None
    except OSError as e:
        own, error = {}, f"rank {_rank()}: checksumming {tmp} failed: {e}"
    gathered = _gather((own, error))
    _on_rank0(
        lambda: _commit_on_rank0(tmp, target, info, gathered, keep_last, faults), f"committing {target}"
    )
    prune_incomplete(target.parent, keep_incomplete)


def _commit_on_rank0(
    tmp: Path, target: Path, info: dict, gathered: list, keep_last: int, faults: FaultInjector | None = None
) -> None:
    errors = [error for _, error in gathered if error]
    if errors:
        raise CheckpointError("; ".join(errors))
    files: dict[str, dict[str, Any]] = {}
    for own, _ in gathered:
        files.update(own)
    for p in _files(tmp):
        rel = p.relative_to(tmp).as_posix()
        if rel not in files:
            log.warning("%s: written by no rank's rule; checksummed by rank 0", p)
            files[rel] = _file_record(p, fsync=True)
    _write_marker(tmp, {**info, "format": FORMAT_VERSION, "time": time.time(), "files": files})
    _rename_into_place(tmp, target)
    if faults is not None:
        faults.check("ckpt_commit", int(info["iteration"]))
    _write_atomic(target.parent / LATEST, target.name + "\n")
    _prune(target.parent, keep_last)


def _write_marker(directory: Path, meta: dict[str, Any]) -> None:
    _write_atomic(directory / MARKER, json.dumps(meta, indent=1, sort_keys=True) + "\n")


def _rename_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` (a repeated save) is moved aside first."""
    aside = None
    if target.exists():
        aside = target.with_name(f"trash.{target.name}.{secrets.token_hex(4)}")
        log.warning("%s exists; replacing it with the new save", target)
        os.rename(target, aside)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def mark_final(path: Path) -> None:
    """Mark the committed checkpoint ``path`` as the stage's final one (kept by retention); one process."""
    path = Path(path)
    meta = _read_marker(path)
    meta["final"] = True
    _write_marker(path, meta)


def _prune(ckpt_root: Path, keep_last: int) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last`` non-final ones; keep final ones.

    Only directories whose marker reads are candidates: incomplete or unreadable ones are left alone.
    """
    kept = 0
    for _, path in _iter_dirs(ckpt_root):
        try:
            meta = _read_marker(path)
        except CheckpointError:
            continue
        if meta.get("final"):
            continue
        if kept < keep_last:
            kept += 1
            continue
        try:
            os.rename(path, path.with_name(f"trash.{path.name}.{secrets.token_hex(4)}"))
            log.info("retention: deleting %s", path)
        except OSError as e:
            log.warning("retention: could not delete %s: %s", path, e)
    for trash in ckpt_root.glob("trash.*"):
        shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------- load


def load(
    path: Path,
    *,
    model_chunks: list,
    optimizer: Any = None,
    scheduler: Any = None,
    models: dict[str, tuple[list, Any, Any]] | None = None,
    verify: str | None = None,
) -> dict:
    """Restore model, optimizer, scheduler and RNG states from checkpoint ``path``; collective.

    ``models``: the other trained models saved with it (``save``'s ``models``), restored from their parts.
    ``verify``: check the files in this mode (``VERIFY_MODES``) while loading (``_OverlappedCheck``); bad
    files raise ``CorruptCheckpoint`` before any tensor reaches the model or optimizer. None: the caller
    verified ``path`` (``find_latest``); sizes and the marker are checked in any case.

    The parallel layout may differ from the saving run's (dist_checkpointing reshards TP/PP/DP); RNG
    states are then left as they are (a warning says so). Returns the saved ``state`` dict with
    ``iteration`` and ``torch_threads`` (the saving run's thread count) added.
    """
    path = Path(path)
    start = time.monotonic()
    loaded = _load_checked(path, model_chunks, optimizer, models, verify)
    from engine.models.lora import has_lora

    _load_model(model_chunks, loaded, path, strict=not has_lora(model_chunks))  # LoRA: adapters only
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    common = loaded[_COMMON_KEY]
    _load_scheduler(scheduler, common, path)
    for name, (chunks, opt, sch) in (models or {}).items():
        _load_model(chunks, loaded, path, name=name)
        if opt is not None:
            opt.load_state_dict(loaded[f"{name}.optimizer"])
        if sch is not None:
            saved = common.get("schedulers", {}).get(name)
            _load_scheduler(sch, {"scheduler": saved}, path)
    _restore_rng(path)
    _warn_thread_count(common, path)
    log.info("loaded %s in %.2f s", path, time.monotonic() - start)
    return {**common["state"], "iteration": common["iteration"], "torch_threads": common["torch_threads"]}


def _load_checked(
    path: Path, model_chunks: list, optimizer: Any, models: dict | None, mode: str | None
) -> dict[str, Any]:
    """dist_checkpointing's load of every part, verified in ``mode`` on the way (``load``)."""
    from engine.checkpoint import optim_fix

    check = _overlapped_check(path, mode)
    try:
        _require_committed(path)
        optim_fix.apply()
        sharded = _sharded_state_dict(model_chunks, optimizer, is_loading=True, models=models)
        with _gated_reads(check):
            loaded = _dist_load(sharded, path)
        if check is not None:
            check.gate()  # agreed at the first read already; here only when nothing was read
    except WRITE_FAILURES:  # the gate's CorruptCheckpoint arrives wrapped by torch's reader
        if check is not None and check.problems:
            raise CorruptCheckpoint(path, check.problems) from None
        raise
    finally:
        if check is not None:
            check.wait()
    return loaded


def _overlapped_check(path: Path, mode: str | None) -> _OverlappedCheck | None:
    """The check ``load`` overlaps with reading (None: nothing to hash). Where megatron's reader cannot be
    gated (another version), ``path`` is verified here instead, before anything is read."""
    if mode is None or mode == "sizes":
        return None
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    if not hasattr(strategy, "_get_filesystem_reader"):
        problems = verify_collective(path, mode)
        if problems:
            raise CorruptCheckpoint(path, problems)
        return None
    return _OverlappedCheck(path, mode)


def load_latest(
    ckpt_root: Path, *, before_load: Callable[[], Any] | None = None, **kwargs: Any
) -> tuple[Path, dict] | None:
    """Resume: the newest good checkpoint under ``ckpt_root``, loaded (``load``'s keywords), or None.

    Collective. Candidates are picked by marker and sizes (``find_latest`` in ``sizes`` mode) and their
    contents verified in the process's mode (``set_verify_mode``, ``full`` unless changed) while they load.
    A checkpoint found bad is skipped (a warning names the file and the fault; nothing of it is kept) and
    the next older one is tried, as ``find_latest`` does. ``before_load`` runs before each try.

    A load that failed has already prepared the optimizer for that checkpoint's state (megatron fills it
    before the first read), so a fresh start after it would not be a clean one. Hence the oldest candidate,
    when nothing failed before it, is verified before it loads (None when it is bad: a clean fresh start),
    and when every candidate failed after such a load this raises ``CheckpointError`` naming them.
    """
    failed: list[str] = []
    path = find_latest(ckpt_root, mode="sizes")
    while path is not None:
        iteration = int(_ITER_DIR.match(path.name).group(1))  # type: ignore[union-attr]
        older = find_latest(ckpt_root, mode="sizes", below=iteration)  # the next candidate, if any
        if before_load is not None:
            before_load()
        if older is None and not failed:
            if problems := verify_collective(path, _VERIFY_MODE):
                _warn_skipped(path, problems)
                return None
            return path, load(path, verify=None, **kwargs)
        try:
            return path, load(path, verify=_VERIFY_MODE, **kwargs)
        except CorruptCheckpoint as e:
            _warn_skipped(path, e.problems)
            failed.append(path.name)
            path = older
    if failed:
        raise CheckpointError(
            f"{ckpt_root}: no checkpoint verifies ({', '.join(failed)} failed while loading); this process's "
            "optimizer was already prepared by a failed load, so it does not start fresh: move the bad "
            "checkpoints aside (or delete them) and run the stage again to start from scratch"
        )
    return None


def _warn_skipped(path: Path, problems: list[str]) -> None:
    if _rank() == 0:
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))


def load_weights(path: Path, model_chunks: list, *, fresh: tuple[str, ...] = ()) -> None:
    """Load only the model weights of checkpoint ``path`` (``init_from``: fresh optimizer and schedule).

    A LoRA stage's checkpoint (adapters only) loads as its base weights (recorded in it) with the adapters
    merged in (engine/models/lora.py). Into a model with adapters, only the base weights are loaded.
    ``fresh``: name prefixes of parameters the checkpoint does not hold, kept as initialised (the reward
    model's head on an SFT checkpoint); every other parameter must load.
    """
    path = Path(path)
    _require_committed(path)
    from engine.models import lora

    rec = lora.checkpoint_record(path)
    if rec is not None:
        _load_lora_merged(path, model_chunks, rec)
        return
    sharded = _sharded_state_dict(model_chunks, None, is_loading=True, part="base")
    if fresh:
        sharded = {
            k: {n: v for n, v in sd.items() if not n.startswith(fresh)} if k.startswith("model") else sd
            for k, sd in sharded.items()
        }
    strict = not lora.has_lora(model_chunks)
    _load_model(model_chunks, _dist_load(sharded, path), path, strict=strict, fresh=fresh)


def _load_lora_merged(path: Path, model_chunks: list, rec: dict[str, Any]) -> None:
    """A LoRA checkpoint as weights: the base it records (a Hugging Face directory or a checkpoint, itself
    maybe LoRA), then its adapters merged in (each rank its shard)."""
    from engine.models import lora
    from engine.models.hf_weights import load_hf
    from engine.runtime.distributed import tp_rank
    from pipeline.schema.hf_arch import is_hf_dir, model_config, parse_ref

    if not rec.get("base"):
        raise CheckpointError(f"{path}: a LoRA checkpoint without a recorded base")
    base = parse_ref(str(rec["base"])) or Path(rec["base"])
    if is_hf_dir(base):
        load_hf(model_chunks, base, model_config(base))
    else:
        found = base if (base / MARKER).is_file() else find_latest(base)
        if found is None:
            raise CheckpointError(f"{path}: its LoRA base {base} has no complete checkpoint")
        load_weights(found, model_chunks)
    tp_size = int(lora.unwrap(model_chunks[0]).config.tensor_model_parallel_size)
    lora.merge_checkpoint(path, load_tensors(path), model_chunks, rec, tp_rank(), tp_size)


def _dist_load(sharded: dict[str, Any], path: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(sharded, str(path))  # type: ignore[return-value]
    except Exception as e:
        raise CheckpointError(f"{path}: dist_checkpointing.load failed: {type(e).__name__}: {e}") from e


def _require_committed(path: Path) -> None:
    problems = verify(path, checksums=False)
    if problems:
        raise CheckpointError(f"refusing to load {path}: " + "; ".join(problems))
    check_loads_without_code(path)


def _load_model(
    model_chunks: list,
    loaded: dict,
    path: Path,
    name: str | None = None,
    strict: bool = True,
    fresh: tuple[str, ...] = (),
) -> None:
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(model_chunks))
    prefix = f"{name}." if name else ""
    for i, chunk in enumerate(chunks):
        key = prefix + _model_key(i, len(chunks))
        try:
            state = loaded[key]
            if prefix:
                state = {k.removeprefix(prefix): v for k, v in state.items()}
            if fresh:
                result = chunk.load_state_dict(state, strict=False)
                bad = [n for n in result.missing_keys if not n.startswith(fresh)] + list(
                    result.unexpected_keys
                )
                if bad:
                    raise RuntimeError(f"missing or unexpected keys {bad[:5]}")
                continue
            missing, unexpected = chunk.load_state_dict(state, strict=strict)
        except (KeyError, RuntimeError) as e:
            raise CheckpointError(f"{path}: model chunk {key!r} does not load: {e}") from e
        if unexpected:  # not strict (a LoRA model: base or adapters only); every requested key was loaded
            raise CheckpointError(f"{path}: model chunk {key!r}: unexpected keys {unexpected[:5]}")


def _load_scheduler(scheduler: Any, common: dict, path: Path) -> None:
    if scheduler is None:
        return
    if common.get("scheduler") is None:
        raise CheckpointError(f"{path}: saved without scheduler state, but a scheduler was given")
    # megatron's load_state_dict steps *by* the saved count: a live scheduler (a rollback) restarts from 0
    scheduler.num_steps = 0
    scheduler.load_state_dict(common["scheduler"])


def _warn_thread_count(common: dict, path: Path) -> None:
    saved, now = common.get("torch_threads"), torch.get_num_threads()
    if saved != now:
        log.warning(
            "%s was saved with %s torch threads, running with %s: CPU sums may differ", path, saved, now
        )


# ---------------------------------------------------------------------------- state dicts


def _model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _sharded_state_dict(
    model_chunks: list,
    optimizer: Any,
    *,
    is_loading: bool,
    models: dict[str, tuple[list, Any, Any]] | None = None,
    part: str = "state",
) -> dict[str, Any]:
    """The sharded state of the main model (``part``: state, what a checkpoint of it holds: everything, or
    the adapters only for a LoRA model, whose base weights come from its init_from; or base, the weights
    without adapters) and of each named trained model (``models``, their state)."""
    sharded = _model_part(model_chunks, optimizer, is_loading, "", part)
    for name, (chunks, opt, _) in (models or {}).items():
        if not name or "." in name or name in ("model", "optimizer", _COMMON_KEY):
            raise CheckpointError(f"model name {name!r}: a plain name without dots, not model/optimizer")
        sharded.update(_model_part(chunks, opt, is_loading, name, "state"))
    return sharded


def _model_part(
    model_chunks: list, optimizer: Any, is_loading: bool, name: str, part: str = "state"
) -> dict[str, Any]:
    """One model's part: ``[<name>.]model[i]`` (tensor keys prefixed ``<name>.``) and its optimizer."""
    from megatron.core.utils import unwrap_model

    from engine.models.lora import has_lora, is_adapter_key

    chunks = unwrap_model(list(model_chunks))
    prefix = f"{name}." if name else ""
    sharded: dict[str, Any] = {
        prefix + _model_key(i, len(chunks)): c.sharded_state_dict(prefix=prefix)
        if prefix
        else c.sharded_state_dict()
        for i, c in enumerate(chunks)
    }
    if has_lora(chunks):
        keep = (lambda k: is_adapter_key(k)) if part == "state" else (lambda k: not is_adapter_key(k))
        sharded = {m: {k: v for k, v in sd.items() if keep(k)} for m, sd in sharded.items()}
    if optimizer is not None:
        metadata = _DISTOPT_METADATA if _is_distributed_optimizer(optimizer) else None
        sharded[prefix + "optimizer"] = optimizer.sharded_state_dict(
            sharded, is_loading=is_loading, metadata=metadata
        )
    return sharded


def _is_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


# ---------------------------------------------------------------------------- RNG


def _layout() -> dict[str, int]:
    """World size and, when megatron's model parallel state is up, the TP/PP/DP sizes."""
    layout = {"world": _world()}
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return layout
    if ps.model_parallel_is_initialized():
        layout |= {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
        }
    return layout


def _tracker() -> Any:
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker()


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states as tensors and plain values only: the file loads with ``weights_only=True``."""
    tracker = _tracker()
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    return {
        "layout": _layout(),
        "python": {
            "version": py_version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in tracker.get_states().items()} if tracker else None,
    }


def _restore_rng(path: Path) -> None:
    file = path / f"rng.rank{_rank()}.pt"
    if not file.is_file():
        log.warning("%s: missing; RNG states not restored", file)
        return
    saved = _load_plain(file)
    if saved["layout"] != _layout():
        log.warning(
            "%s: saved under layout %s, now %s; RNG states not restored", file, saved["layout"], _layout()
        )
        return
    py, npy = saved["python"], saved["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state(
        (
            npy["name"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    tracker = _tracker()
    if saved["tracker"] and tracker is not None:
        tracker.set_states(saved["tracker"])


# ---------------------------------------------------------------------------- loading without running code


def _load_plain(file: Path) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors and plain values, never arbitrary objects."""
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        raise CheckpointError(
            f"{file}: refusing to load: it holds more than tensors and plain values (a checkpoint from "
            f"an older version, or a crafted one that would run code): {str(e).splitlines()[0]}"
        ) from None


_METADATA_GLOBALS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
}
"""Globals a DCP ``.metadata`` pickle may name, besides the classes of torch.distributed.checkpoint's
metadata modules and torch dtypes/layouts/memory formats (see ``_MetadataUnpickler``)."""

_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)


class _MetadataUnpickler:
    """Reads a DCP ``.metadata`` pickle, refusing any global outside the allowlist (nothing else can run)."""

    @staticmethod
    def load(file: Path) -> Any:
        import dataclasses
        import enum
        import importlib
        import pickle

        class Restricted(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                allowed = (module, name) in _METADATA_GLOBALS
                if not allowed and module in _METADATA_MODULES and "." not in name:
                    obj = getattr(importlib.import_module(module), name, None)
                    allowed = isinstance(obj, type) and (
                        dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
                    )
                if not allowed and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                    allowed = True
                if not allowed:
                    raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
                return super().find_class(module, name)

        with open(file, "rb") as f:
            return Restricted(f).load()


def check_loads_without_code(path: Path) -> None:
    """Raise CheckpointError unless every pickled part of checkpoint ``path`` loads without running code.

    torch's distributed checkpoint unpickles ``.metadata`` (and any non-tensor "bytes" items) with the
    full unpickler; megatron's ``common.pt`` and our ``rng.rank*.pt`` are torch pickles. Each is read here
    first under a restricted unpickler (``.metadata``: torch's checkpoint metadata classes only; ``*.pt``
    and bytes items: ``weights_only=True``), so the loads that follow meet only allowed objects.
    """
    import io
    import pickle

    path = Path(path)
    meta_file = path / ".metadata"
    if meta_file.is_file():
        try:
            meta = _MetadataUnpickler.load(meta_file)
        except Exception as e:
            raise CheckpointError(
                f"{meta_file}: refusing to load: not a plain torch checkpoint metadata file ({e})"
            ) from None
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        storage = getattr(meta, "storage_data", None) or {}
        for fqn, item in getattr(meta, "state_dict_metadata", {}).items():
            if not isinstance(item, BytesStorageMetadata):
                continue
            for index, info in storage.items():
                if index.fqn != fqn:
                    continue
                with open(path / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    blob = f.read(info.length)
                try:
                    torch.load(io.BytesIO(blob), weights_only=True)
                except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
                    raise CheckpointError(
                        f"{path / info.relative_path}: refusing to load item {fqn!r}: it holds more than "
                        f"tensors and plain values ({str(e).splitlines()[0]})"
                    ) from None
    for file in sorted(path.glob("*.pt")):
        _load_plain(file)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a committed checkpoint (model and optimizer state), by name, on CPU.

    Needs no process group or model: for inspection, export and exact comparisons between runs.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _require_committed(Path(path))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "state.pt"
        dcp_to_torch_save(str(path), str(out))
        state = torch.load(out, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
