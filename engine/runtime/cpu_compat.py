"""The only CPU workaround for megatron-core: runtime patches that let it train without CUDA.

megatron-core assumes CUDA in a few dozen places (``torch.cuda.current_device()`` as a device,
``device="cuda"`` literals, ``torch.cuda.synchronize()``, the CUDA RNG tracker, type checks against
``'torch.cuda.FloatTensor'``), plus one CPU speed-up with the same results (the cross entropy's logits
maximum by ``amax``). ``install()`` patches exactly the symbols in ``PATCHES`` and does nothing when CUDA
is available. Call it in each rank after ``init_process_group("gloo")`` (engine.runtime.distributed
does). ``tests/engine/runtime/test_engine_cpu_compat.py`` checks every entry of ``PATCHES`` against the installed
torch/megatron: a symbol that disappears or whose parameters change fails the test loudly.

The model-parallel RNG tracker is backed by the CPU generator: a ``fork()`` swaps the CPU generator's state
in and out, so megatron's "CPU RNG state changed within GPU RNG context" warning is expected and filtered.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_CPU = torch.device("cpu")


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device (``"cuda"``, ``"cuda:0"``, ``torch.device('cuda')``, an ordinal) to the CPU."""
    if isinstance(device, bool) or device is None:
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _NoStream:
    """Stands in for torch.cuda.Stream and torch.cuda.Event: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name == "record_event":  # an event to synchronize on later (the MoE token dispatcher's)
            return lambda *a, **k: _NoStream()
        return lambda *a, **k: None if name != "query" else True


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _factory(orig: Callable[..., Any]) -> Callable[..., Any]:
    def factory(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        return orig(*args, device=_cpu_device(device), **kwargs)

    return factory


def _tensor_to(orig: Callable[..., Any]) -> Callable[..., Any]:
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args and not isinstance(args[0], torch.dtype | torch.Tensor):
            args = (_cpu_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return orig(self, *args, **kwargs)

    return to


def _tensor_type(orig: Callable[..., Any]) -> Callable[..., Any]:
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            name = orig(self)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.", 1)
        return orig(self, dtype, non_blocking, **kwargs)

    return type_


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's cross-entropy ``calculate_logits_max`` with ``amax``: the same values, no argmax indices.

    ``torch.max(x, dim=-1)[0]`` computes the indices too: on CPU 1.05 ms against 0.30 ms for ``amax`` on the
    [1024, 4096] logits of bench/bench_attention.py's micro batch (2 threads), once per micro batch.
    """
    vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, torch.amax(vocab_parallel_logits, dim=-1)


def _to_host(orig: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``maybe_move_tensor_to_cpu`` converts to numpy only what it moves from a GPU: the MoE
    all-to-all dispatcher's split sizes stay tensors on CPU, which ``all_to_all_single`` refuses."""

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return to_host


@dataclass(frozen=True)
class Patch:
    """One patched symbol: ``owner.name`` is replaced by ``make(original)``."""

    owner: str
    """Dotted path of the module or class holding the symbol."""
    name: str
    """Attribute name."""
    params: tuple[str, ...] | None
    """Parameter names of the original, checked by the tests (None: builtin or class, existence only)."""
    make: Callable[[Any], Any]
    """Builds the replacement from the original."""


_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint")

PATCHES: tuple[Patch, ...] = (
    Patch("torch.cuda", "current_device", (), lambda o: lambda: _CPU),
    Patch("torch.cuda", "synchronize", ("device",), lambda o: _noop),
    Patch("torch.cuda", "empty_cache", (), lambda o: _noop),
    Patch("torch.cuda", "current_stream", ("device",), lambda o: lambda device=None: _NoStream()),
    Patch("torch.cuda", "default_stream", ("device",), lambda o: lambda device=None: _NoStream()),
    Patch("torch.cuda", "stream", ("stream",), lambda o: lambda stream: contextlib.nullcontext()),
    Patch("torch.cuda", "Stream", None, lambda o: _NoStream),
    Patch("torch.cuda", "Event", None, lambda o: _NoStream),
    Patch("torch.cuda", "get_rng_state", ("device",), lambda o: _get_rng_state),
    Patch("torch.cuda", "set_rng_state", ("new_state", "device"), lambda o: _set_rng_state),
    Patch("torch.cuda", "manual_seed", ("seed",), lambda o: torch.manual_seed),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        ("device", "clone", "graph_safe"),
        lambda o: _get_rng_state,
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        ("new_state", "device", "graph_safe"),
        lambda o: _set_rng_state,
    ),
    *(Patch("torch", f, None, _factory) for f in _FACTORIES),
    Patch("torch.Tensor", "to", None, _tensor_to),
    Patch("torch.Tensor", "cuda", None, lambda o: lambda self, *a, **k: self),
    Patch("torch.Tensor", "type", None, _tensor_type),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "maybe_move_tensor_to_cpu",
        ("tensor", "as_numpy", "record_stream"),
        _to_host,
    ),
    Patch(
        "megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy",
        "calculate_logits_max",
        ("vocab_parallel_logits",),
        lambda o: staticmethod(_logits_max),
    ),
)

_ORIGINALS: dict[tuple[str, str], Any] = {}
_RNG_LOGGER = "megatron.core.tensor_parallel.random"


class _ForkWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FILTER = _ForkWarningFilter()


def resolve(path: str) -> Any:
    """Import ``path`` as a module, or as ``module.Class`` when the whole path is not a module."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(module), attr)


def needed() -> bool:
    """True when CUDA is absent, i.e. when install() would patch."""
    return not torch.cuda.is_available()


def installed() -> bool:
    return bool(_ORIGINALS)


def skip_torch_compile() -> None:
    """Make ``torch.compile`` a no-op in this process (``TORCHDYNAMO_DISABLE=1`` unless already set); CPU only.

    megatron-core wraps its fused helpers in ``torch.compile`` at import time, which imports TorchInductor:
    1.5 s of every training job's start-up here. On CPU none of those helpers is on our path (bias and
    activation fusions are off) and compiling them with Inductor would cost more than it saves. Call before
    megatron is imported; ``TORCHDYNAMO_DISABLE=0`` in the environment keeps torch.compile.
    """
    if not needed():
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


MISSING_WITHOUT_TE: tuple[tuple[str, str], ...] = (
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm"),
)
"""Names megatron-core 0.16 reads but defines only when Transformer Engine imports (the MoE router's gating
GEMM tests ``te_general_gemm is not None``: a NameError without TE, on CPU and on GPUs alike)."""


def define_missing_te_names() -> list[str]:
    """Define each MISSING_WITHOUT_TE name as None where megatron left it undefined (CPU or GPU without TE);
    returns the names defined. Idempotent; names that exist (TE installed) are left alone."""
    defined = []
    for owner, name in MISSING_WITHOUT_TE:
        module = resolve(owner)
        if not hasattr(module, name):
            setattr(module, name, None)
            defined.append(f"{owner}.{name}")
    return defined


def install() -> bool:
    """Patch every symbol in PATCHES (idempotent; a no-op with CUDA). Returns whether patches are active."""
    if not needed():
        return False
    if installed():
        return True
    for p in PATCHES:
        owner = resolve(p.owner)
        original = getattr(owner, p.name)
        _ORIGINALS[(p.owner, p.name)] = original
        setattr(owner, p.name, p.make(original))
    logging.getLogger(_RNG_LOGGER).addFilter(_FILTER)
    return True


def uninstall() -> None:
    """Restore the originals (for tests)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(resolve(owner), name, original)
    _ORIGINALS.clear()
    logging.getLogger(_RNG_LOGGER).removeFilter(_FILTER)
