"""Loading a checkpoint: full state (resume, verified while it loads), weights only (init_from, LoRA merged),
and every tensor without a model (inspection, export).

The parallel layout may differ from the saving run's (dist_checkpointing reshards TP/PP/DP); RNG states
are then left as they are. megatron is imported lazily, so callers that never train stay cheap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.errors import WRITE_FAILURES, CheckpointError, CorruptCheckpoint
from engine.checkpoint.integrity import verify, verify_collective, verify_mode
from engine.checkpoint.latest import find_latest
from engine.checkpoint.layout import ITER_DIR, MARKER
from engine.checkpoint.overlap import gated_reads, overlapped_check
from engine.checkpoint.rng import restore_rng
from engine.checkpoint.state import COMMON_KEY, model_key, sharded_state_dict
from engine.checkpoint.unpickle import check_loads_without_code
from engine.runtime.distributed import rank as _rank

log = logging.getLogger(__name__)


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
    ``verify``: check the files in this mode (``VERIFY_MODES``) while loading (``OverlappedCheck``); bad
    files raise ``CorruptCheckpoint`` before any tensor reaches the model or optimizer. None: the caller
    verified ``path`` (``find_latest``); sizes and the marker are checked in any case.

    RNG states are restored only under the saving run's layout (else a warning says so). Returns the saved
    ``state`` dict with ``iteration`` and ``torch_threads`` (the saving run's thread count) added.
    """
    path = Path(path)
    start = time.monotonic()
    loaded = _load_checked(path, model_chunks, optimizer, models, verify)
    from engine.models.lora import has_lora

    _load_model(model_chunks, loaded, path, strict=not has_lora(model_chunks))  # LoRA: adapters only
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    common = loaded[COMMON_KEY]
    _load_scheduler(scheduler, common, path)
    for name, (chunks, opt, sch) in (models or {}).items():
        _load_model(chunks, loaded, path, name=name)
        if opt is not None:
            opt.load_state_dict(loaded[f"{name}.optimizer"])
        if sch is not None:
            saved = common.get("schedulers", {}).get(name)
            _load_scheduler(sch, {"scheduler": saved}, path)
    restore_rng(path)
    _warn_thread_count(common, path)
    log.info("loaded %s in %.2f s", path, time.monotonic() - start)
    return {**common["state"], "iteration": common["iteration"], "torch_threads": common["torch_threads"]}


def _load_checked(
    path: Path, model_chunks: list, optimizer: Any, models: dict | None, mode: str | None
) -> dict[str, Any]:
    """dist_checkpointing's load of every part, verified in ``mode`` on the way (``load``)."""
    from engine.checkpoint import optim_fix

    check = overlapped_check(path, mode)
    try:
        require_committed(path)
        optim_fix.apply()
        sharded = sharded_state_dict(model_chunks, optimizer, is_loading=True, models=models)
        with gated_reads(check):
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
        iteration = int(ITER_DIR.match(path.name).group(1))  # type: ignore[union-attr]
        older = find_latest(ckpt_root, mode="sizes", below=iteration)  # the next candidate, if any
        if before_load is not None:
            before_load()
        if older is None and not failed:
            if problems := verify_collective(path, verify_mode()):
                _warn_skipped(path, problems)
                return None
            return path, load(path, verify=None, **kwargs)
        try:
            return path, load(path, verify=verify_mode(), **kwargs)
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
    require_committed(path)
    from engine.models import lora

    rec = lora.checkpoint_record(path)
    if rec is not None:
        _load_lora_merged(path, model_chunks, rec)
        return
    sharded = sharded_state_dict(model_chunks, None, is_loading=True, part="base")
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


def require_committed(path: Path) -> None:
    """Raise CheckpointError unless ``path`` is a committed checkpoint (marker and sizes) whose pickled
    parts load without running code."""
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
        key = prefix + model_key(i, len(chunks))
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


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a committed checkpoint (model and optimizer state), by name, on CPU.

    Needs no process group or model: for inspection, export and exact comparisons between runs.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    require_committed(Path(path))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "state.pt"
        dcp_to_torch_save(str(path), str(out))
        state = torch.load(out, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
