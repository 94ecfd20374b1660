"""Process groups, model-parallel state and seeds: the only module calling init_process_group / parallel_state.

The layout is given by the caller (``init(env=ctx.dist)``: the launcher's job environment,
pipeline.submit.launch.run_stage); without one it comes from torch.distributed's own env rendezvous contract
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: ``env_from_os``), and without those the process is a
single rank on a free port.
Backend: nccl with CUDA, gloo without (and then engine.runtime.cpu_compat is installed).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.context import DistEnv as DistEnv  # re-exported: the place of a rank
from engine.runtime import host_memory, vml
from pipeline.slurm.job_env import free_port  # noqa: F401  (re-exported: tests and workers pick ports here)


def _env_int(environ: Mapping[str, str], key: str, default: int) -> int:
    value = environ.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r}: must be an integer") from None


def env_from_os(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the layout from the environment (torchrun variables); default: one rank on a free port."""
    environ = os.environ if environ is None else environ
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world}: must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank}: must be in [0, WORLD_SIZE={world})")
    if world > 1 and "MASTER_PORT" not in environ:
        raise ValueError(f"MASTER_PORT: required when WORLD_SIZE={world} > 1")
    port = _env_int(environ, "MASTER_PORT", 0) or free_port()
    addr = environ.get("MASTER_ADDR") or "127.0.0.1"
    return DistEnv(rank, world, _env_int(environ, "LOCAL_RANK", 0), addr, port)


HIDDEN_AT_MEGATRON_IMPORT = ("wandb", "torch.utils.tensorboard")
"""Optional packages megatron.core imports at its own import and the engine never uses through it: hidden
(``import`` raises ImportError) while megatron.core imports, so it takes them as absent. ``wandb`` is ~1 s of
a job's start-up (megatron's dynamic inference context and timers import it for their metrics writers),
tensorboard ~0.5 s (megatron's Timers.write); our own ``monitor.wandb``/``monitor.tensorboard`` import them
later, unaffected."""


def import_megatron() -> None:
    """Import megatron.core for a job, without the start-up that the job cannot use (idempotent).

    - the packages in HIDDEN_AT_MEGATRON_IMPORT are hidden during the import;
    - with ``TORCHDYNAMO_DISABLE=1`` (cpu_compat.skip_torch_compile; torch.compile then returns the function
      unchanged) ``torch.compile`` is the identity while megatron decorates its fused helpers at import:
      the same functions, without importing torch._dynamo (~0.7 s). Called after the variable is cleared it
      is torch.compile again.
    """
    import importlib
    import sys

    if "megatron.core" in sys.modules:
        return
    hidden = [name for name in HIDDEN_AT_MEGATRON_IMPORT if name not in sys.modules]
    real_compile = torch.compile
    try:
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]
        if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
            torch.compile = _compile_or_identity(real_compile)  # type: ignore[assignment]
        importlib.import_module("megatron.core")
    finally:
        torch.compile = real_compile  # type: ignore[assignment]
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def prepare_imports() -> None:
    """What a job does before it touches megatron: torch.compile off on CPU, megatron.core imported (as
    ``import_megatron``), the CPU workarounds installed. Also run by a prefork server (pipeline.submit.prefork)."""
    from engine.runtime import cpu_compat

    cpu_compat.skip_torch_compile()
    import_megatron()
    cpu_compat.define_missing_te_names()  # with or without CUDA: megatron's MoE router without TE
    cpu_compat.install()


def _compile_or_identity(real: Any) -> Any:
    """torch.compile's result under TORCHDYNAMO_DISABLE=1 (the function itself), without importing dynamo."""

    def compile(model: Any = None, **kwargs: Any) -> Any:
        if os.environ.get("TORCHDYNAMO_DISABLE") != "1" or kwargs.get("backend") not in (None, "inductor"):
            return real(model, **kwargs)
        if model is None:  # decorator with arguments: @torch.compile(...)
            return lambda fn: fn
        return model

    return compile


def init(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    *,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    threads: int = 2,
    env: DistEnv | None = None,
    timeout_s: int = 1800,
) -> DistEnv:
    """Start the process group, megatron's model-parallel groups and seed every generator (``env``: this
    rank's place, from the caller; default: torch's env rendezvous variables, ``env_from_os``). ``ep`` /
    ``etp``: expert (tensor) parallel sizes; megatron carves the expert groups out of tp x dp."""
    env = env or env_from_os()
    if env.world_size % (tp * pp):
        raise ValueError(
            f"parallel.tp x parallel.pp = {tp * pp}: does not divide WORLD_SIZE={env.world_size}"
        )
    if env.world_size % (ep * (etp or tp) * pp):
        raise ValueError(
            f"parallel.ep x etp x pp = {ep * (etp or tp) * pp}: does not divide WORLD_SIZE={env.world_size}"
        )
    vml.warm()  # before any multi-threaded float op: MKL's first-call race (engine.runtime.vml)
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank)
    else:
        host_memory.keep_freed_memory()
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    prepare_imports()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        with share_the_default_group(world_timeout=timedelta(seconds=timeout_s)):
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
            )
    set_seed(seed)
    return env


@contextmanager
def share_the_default_group(*, world_timeout: timedelta) -> Iterator[None]:
    """While megatron builds its groups on gloo, let those that span the whole world be the default group.

    ``initialize_model_parallel`` asks for about 20 groups (data, tensor, pipeline, embedding, expert,
    ``*_GLOO`` copies, ...). Each gloo group owns a transport device whose event-loop thread wakes every
    10 ms: on one rank, where all 20 are ``[0]``, that is 2,000 wake-ups a second preempting the compute
    threads (docs/benchmarks.md has what that costs). Here a group of every rank with
    the default group's timeout (``world_timeout``) is the default group itself (one rank: one event loop in
    all). Safe for collectives: every rank asks for the same groups in the same order, and the default group
    runs its operations in the order each rank issues them, as separate groups of the same ranks would.

    Only the default group is shared: sharing every group of the same ranks crashed at interpreter exit (a gloo
    worker thread freeing a finished all-reduce while Python finalized). On more than one rank the ``*_GLOO`` groups (which
    megatron destroys itself) keep their own group. Calls with options or local synchronization are passed
    through; NCCL groups are never touched (separate communicators and streams are what GPU overlap uses).
    """
    from megatron.core import parallel_state
    from torch.distributed.constants import default_pg_timeout

    world = dist.get_world_size()
    create = parallel_state.create_group

    def shared(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
        backend, timeout = kwargs.get("backend"), kwargs.get("timeout") or default_pg_timeout
        whole = ranks is not None and sorted(ranks) == list(range(world)) and timeout == world_timeout
        plain = kwargs.get("pg_options") is None and not kwargs.get("use_local_synchronization")
        if whole and plain and (backend is None or (backend == "gloo" and world == 1)):
            return dist.group.WORLD
        return create(ranks, **kwargs)

    if dist.get_backend() == "gloo":  # the CPU backend (init: nccl with CUDA)
        parallel_state.create_group = shared
    try:
        yield
    finally:
        parallel_state.create_group = create


_BASE_SEED = 1234


def base_seed() -> int:
    """The seed given to ``init`` (before the per-stage offset): initial weights are drawn from it."""
    return _BASE_SEED


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker (offset per pipeline stage:
    dropout streams differ per stage; initial weights do not, see engine.models.init_weights)."""
    from megatron.core import parallel_state, tensor_parallel

    global _BASE_SEED
    _BASE_SEED = seed
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Destroy megatron's groups and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- layout queries


def _ps() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def device() -> torch.device:
    """The device of this rank's model and of every tensor the engine, eval and the steps create.

    The one place that decides it (CUDA's current device, else the CPU); nothing else in ``stages/`` calls
    ``.cuda()`` or names ``"cuda"`` (tests/engine/runtime/test_device.py checks both).
    """
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def dp_rank() -> int:
    return int(_ps().get_data_parallel_rank())


def dp_size() -> int:
    return int(_ps().get_data_parallel_world_size())


def tp_rank() -> int:
    return int(_ps().get_tensor_model_parallel_rank())


def etp_rank() -> int:
    """This rank's place in its expert-tensor-parallel group (the routed experts' tensor split)."""
    return int(_ps().get_expert_tensor_parallel_rank())


def ep_size() -> int:
    """The expert-parallel group's size (1 without Mixture of Experts parallelism)."""
    return int(_ps().get_expert_model_parallel_world_size()) if world_size() > 1 else 1


def etp_size() -> int:
    return int(_ps().get_expert_tensor_parallel_world_size())


def pp_rank() -> int:
    return int(_ps().get_pipeline_model_parallel_rank())


def pp_size() -> int:
    return int(_ps().get_pipeline_model_parallel_world_size())


def is_first_stage(vp_stage: int | None = None) -> bool:
    return bool(_ps().is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage))


def is_last_stage(vp_stage: int | None = None) -> bool:
    return bool(_ps().is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage))


def owns_loss() -> bool:
    """True on the ranks whose losses count once: the last pipeline stage, tensor-parallel rank 0."""
    return is_last_stage() and tp_rank() == 0


# ---------------------------------------------------------------------------- collectives


def all_reduce_sum(values: Sequence[float] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Sum float64 values over all ranks (every rank gets the result)."""
    t = torch.as_tensor(np.asarray(values, dtype=np.float64)).to(device())
    if world_size() > 1:
        dist.all_reduce(t)
    return t.cpu().numpy()


def reduce_metrics(sums: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Global ratio sum/count of each metric (``sums``: (sum, count) pairs); only loss-owning ranks contribute
    (the rest pass anything)."""
    names = sorted(sums)
    own = owns_loss()
    flat = [x for n in names for x in (sums[n] if own else (0.0, 0.0))]
    total = all_reduce_sum(flat).reshape(-1, 2) if names else np.zeros((0, 2))
    return {n: float(s / c) if c else float("nan") for n, (s, c) in zip(names, total)}


def dp_all_gather(values: np.ndarray) -> np.ndarray:
    """Every data-parallel rank's float64 ``values`` (the same shape on each), concatenated along axis 0 in
    data-parallel rank order, on every rank (the per-row scalars of a rollout each rank sampled its share of)."""
    local = np.ascontiguousarray(np.asarray(values, dtype=np.float64))
    if world_size() == 1 or dp_size() == 1:
        return local
    t = torch.as_tensor(local).to(device())
    out = [torch.empty_like(t) for _ in range(dp_size())]
    dist.all_gather(out, t, group=_ps().get_data_parallel_group())
    return torch.cat(out).cpu().numpy()


def mp_all_reduce_sum(values: Sequence[float] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Sum float64 values over this rank's model-parallel group (its tensor- and pipeline-parallel peers; not
    across data-parallel ranks, which may hold different rows)."""
    t = torch.as_tensor(np.asarray(values, dtype=np.float64)).to(device())
    if world_size() > 1 and world_size() > dp_size():
        dist.all_reduce(t, group=_ps().get_model_parallel_group())
    return t.cpu().numpy()


def all_reduce_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device())
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (stop requests agree, so all ranks stop together)."""
    return all_reduce_max(1.0 if flag else 0.0) > 0


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj``, on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on rank 0 (an empty list elsewhere)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def dp_all_gather_object(obj: Any) -> list[Any]:
    """Every data-parallel rank's ``obj`` (this rank's model-parallel peers' alike), in data-parallel rank order."""
    if world_size() == 1 or dp_size() == 1:
        return [obj]
    out: list[Any] = [None] * dp_size()
    dist.all_gather_object(out, obj, group=_ps().get_data_parallel_group())
    return out


def pp_broadcast_from_last(obj: Any) -> Any:
    """The last pipeline stage's ``obj``, on every stage of this rank's pipeline group."""
    if world_size() == 1 or pp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=pp_last_rank(), group=pp_group())
    return box[0]


def pp_broadcast_tensor(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """The last pipeline stage's float32 tensor ``t`` (of ``shape``; None on the other stages), on every stage."""
    if world_size() == 1 or pp_size() == 1:
        assert t is not None
        return t
    out = t.contiguous() if t is not None else torch.empty(shape, dtype=torch.float32, device=device())
    dist.broadcast(out, src=pp_last_rank(), group=pp_group())
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------- pipeline point-to-point


def pp_group() -> Any:
    return _ps().get_pipeline_model_parallel_group()


def pp_next_rank() -> int:
    """Global rank of the next pipeline stage (wraps from the last stage to the first)."""
    return int(_ps().get_pipeline_model_parallel_next_rank())


def pp_prev_rank() -> int:
    """Global rank of the previous pipeline stage (wraps from the first stage to the last)."""
    return int(_ps().get_pipeline_model_parallel_prev_rank())


def pp_last_rank() -> int:
    """Global rank of this rank's last pipeline stage."""
    return int(_ps().get_pipeline_model_parallel_last_rank())
