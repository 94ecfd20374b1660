"""Saving a checkpoint: atomic commit, async writes, retention.

``save`` is collective over all ranks and commits in this order: every rank writes into the temp
directory; each rank fsyncs and checksums the files it wrote; rank 0 gathers the checksums, writes
``COMPLETE.json``, renames the temp directory to ``iter_<7 digits>`` and then rewrites ``latest``.
A crash at any point leaves either the previous state or a complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.collective import on_rank0
from engine.checkpoint.errors import WRITE_FAILURES, CheckpointError
from engine.checkpoint.integrity import file_record, record_own_files
from engine.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST,
    files,
    iter_dir_name,
    iter_dirs,
    read_marker,
    write_marker,
)
from engine.checkpoint.rng import parallel_layout, rng_file, rng_state
from engine.checkpoint.state import COMMON_KEY, common_state, sharded_state_dict
from engine.checkpoint.writer import async_queue, finalize_async, signal_safe_writer_queue
from engine.runtime.distributed import all_gather_object as _all_gather
from engine.runtime.distributed import gather_object as _gather
from engine.runtime.distributed import rank as _rank
from engine.runtime.distributed import world_size as _world
from engine.runtime.fault_injection import FaultInjector
from pipeline.records.files import atomic_write_text as _write_atomic
from pipeline.records.files import fsync_dir as _fsync_dir

log = logging.getLogger(__name__)


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
    faults: FaultInjector | None = None,
) -> Path:
    """Save a checkpoint of ``iteration`` under ``ckpt_root``; collective over all ranks.

    ``models``: other trained models of the unit (engine.train.units), name -> (chunks, optimizer,
    scheduler); each gets its own part (``<name>.model``, ``<name>.optimizer``, tensors keyed
    ``<name>.<param>``; its schedule in the common state's ``schedulers``). ``faults``: the stage's injector.

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
    common = common_state(iteration, scheduler, state)
    common["schedulers"] = {
        n: sch.state_dict() for n, (_, _, sch) in (models or {}).items() if sch is not None
    }
    rng = rng_state()
    tmp = Path(
        on_rank0(lambda: str(_make_tmp_dir(ckpt_root, iteration)), f"creating a temp dir in {ckpt_root}")
    )
    optim_fix.apply()
    sharded = sharded_state_dict(model_chunks, optimizer, is_loading=False, models=models)
    sharded[COMMON_KEY] = common
    start = time.monotonic()
    is_async = async_save and not final
    signal_safe_writer_queue()
    try:
        request = dist_checkpointing.save(sharded, str(tmp), async_sharded_save=is_async)
        torch.save(rng, tmp / rng_file(_rank()))
        error = None
    except WRITE_FAILURES as e:  # a full disk: OSError, or torch's CheckpointException
        request, error = None, f"rank {_rank()}: writing {tmp} failed: {type(e).__name__}: {_first_line(e)}"
    errors = [x for x in _all_gather(error) if x]
    if errors:
        _discard(tmp)
        raise CheckpointError("; ".join(errors))
    info = {"iteration": iteration, "final": final, "world_size": _world(), "layout": parallel_layout()}

    def commit() -> None:
        if faults is not None:
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
    async_queue().schedule_async_request(request)
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


def _make_tmp_dir(ckpt_root: Path, iteration: int) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f"tmp.{iter_dir_name(iteration)}.{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


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
        own, error = record_own_files(tmp, _rank()), None
    except OSError as e:
        own, error = {}, f"rank {_rank()}: checksumming {tmp} failed: {e}"
    gathered = _gather((own, error))
    on_rank0(lambda: _commit_on_rank0(tmp, target, info, gathered, keep_last, faults), f"committing {target}")
    prune_incomplete(target.parent, keep_incomplete)


def _commit_on_rank0(
    tmp: Path, target: Path, info: dict, gathered: list, keep_last: int, faults: FaultInjector | None = None
) -> None:
    errors = [error for _, error in gathered if error]
    if errors:
        raise CheckpointError("; ".join(errors))
    records: dict[str, dict[str, Any]] = {}
    for own, _ in gathered:
        records.update(own)
    for p in files(tmp):
        rel = p.relative_to(tmp).as_posix()
        if rel not in records:
            log.warning("%s: written by no rank's rule; checksummed by rank 0", p)
            records[rel] = file_record(p, fsync=True)
    write_marker(tmp, {**info, "format": FORMAT_VERSION, "time": time.time(), "files": records})
    _rename_into_place(tmp, target)
    if faults is not None:
        faults.check("ckpt_commit", int(info["iteration"]))
    _write_atomic(target.parent / LATEST, target.name + "\n")
    _prune(target.parent, keep_last)


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
    meta = read_marker(path)
    meta["final"] = True
    write_marker(path, meta)


def _prune(ckpt_root: Path, keep_last: int) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last`` non-final ones; keep final ones.

    Only directories whose marker reads are candidates: incomplete or unreadable ones are left alone.
    """
    kept = 0
    for _, path in iter_dirs(ckpt_root):
        try:
            meta = read_marker(path)
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
