"""Loading the pickled parts of a checkpoint without running code: ``weights_only`` torch loads and a
restricted unpickler for torch's distributed checkpoint metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.errors import CheckpointError


def load_plain(file: Path) -> Any:
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
    path = Path(path)
    meta_file = path / ".metadata"
    if meta_file.is_file():
        try:
            meta = _MetadataUnpickler.load(meta_file)
        except Exception as e:
            raise CheckpointError(
                f"{meta_file}: refusing to load: not a plain torch checkpoint metadata file ({e})"
            ) from None
        _check_bytes_items(path, meta)
    for file in sorted(path.glob("*.pt")):
        load_plain(file)


def _check_bytes_items(path: Path, meta: Any) -> None:
    """Each non-tensor ("bytes") item the metadata lists loads with ``weights_only=True``."""
    import io
    import pickle

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
