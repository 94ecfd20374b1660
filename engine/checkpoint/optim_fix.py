"""Fix for megatron-core's distributed optimizer when it falls back to torch Adam (no TE, no apex).

Without Transformer Engine or apex, ``DistributedOptimizer`` wraps ``torch.optim.Adam``/``AdamW``, whose
per-parameter state holds a ``step`` tensor. In megatron-core 0.16.1 restoring its checkpoint is broken:

1. ``state_dict()`` asserts that all parameters report one ``step``; a fresh optimizer (which is what a
   resuming job has) has no state at all, so ``sharded_state_dict(is_loading=True)`` fails the assert.
2. ``_set_main_param_and_optimizer_states`` copies every key of the live state from the loaded tensors,
   which never carry ``step``: ``KeyError: 'step'``.
3. ``load_state_dict`` gives every parameter the *same* ``step`` tensor; torch Adam increments it in
   place once per parameter, so bias correction is wrong from the first step after a resume.

``apply()`` patches those three methods, only when the installed megatron-core is in ``AFFECTED`` and the
torch fallback is active; each patch changes behaviour only for a plain torch Adam/AdamW inner optimizer
(no CPU offloading, no precision-aware optimizer, no megatron FSDP) and otherwise calls the original.
``tests/engine/checkpoint/test_checkpoint_optim_fix.py`` runs the unpatched path and fails once upstream has fixed it:
then narrow ``AFFECTED`` and, when no supported version needs it, delete this module.
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

import torch

log = logging.getLogger(__name__)

AFFECTED = ((0, 16), (0, 20))
"""megatron-core versions [low, high) known to carry the bug (0.16.1 measured; the pinned range)."""

_ORIGINALS: dict[str, Any] = {}


def _megatron_version() -> tuple[int, int]:
    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def needed() -> bool:
    """True when the installed megatron-core is affected and the distributed optimizer uses torch Adam."""
    from megatron.core.optimizer import distrib_optimizer

    low, high = AFFECTED
    return low <= _megatron_version() < high and not distrib_optimizer.HAVE_APEX_OR_TE


def applied() -> bool:
    return bool(_ORIGINALS)


def apply() -> bool:
    """Install the fix when ``needed()`` (idempotent). Returns whether it is active."""
    if applied():
        return True
    if not needed():
        return False
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    for name, patched in _PATCHES.items():
        _ORIGINALS[name] = getattr(D, name)
        setattr(D, name, patched)
    log.info("optim_fix: patched DistributedOptimizer for the torch Adam fallback")
    return True


def remove() -> None:
    """Restore megatron's original methods (for tests)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    for name, original in _ORIGINALS.items():
        setattr(D, name, original)
    _ORIGINALS.clear()


def _torch_adam(opt: Any) -> bool:
    """The patched case: a plain torch Adam/AdamW under the distributed optimizer."""
    return (
        isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW)
        and not opt.ddp_config.use_megatron_fsdp
        and not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    )


def _state_dict(self: Any) -> dict:
    """Fault 1: a fresh optimizer has no per-parameter ``step`` yet; report step 0 instead of asserting."""
    if not _torch_adam(self) or self.optimizer.state:
        return _ORIGINALS["state_dict"](self)
    inner = self.optimizer.state_dict()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in inner["param_groups"]]
    state_dict: dict[str, Any] = {"optimizer": {"param_groups": groups}}
    if self.grad_scaler:
        state_dict["grad_scaler"] = self.grad_scaler.state_dict()
    return state_dict


def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> None:
    """Fault 2: loaded tensors carry no ``step`` (it comes from the param groups); keep the live one."""
    if _torch_adam(self) and "step" not in tensors:
        live = self._get_main_param_and_optimizer_states(model_param)
        if "step" in live:
            tensors = {**tensors, "step": live["step"]}
    _ORIGINALS["_set_main_param_and_optimizer_states"](self, model_param, tensors)


def _load_state_dict(self: Any, state_dict: dict) -> None:
    """Fault 3: give every parameter its own ``step`` tensor after megatron shared one among all."""
    _ORIGINALS["load_state_dict"](self, state_dict)
    if not _torch_adam(self):
        return
    for param_state in self.optimizer.state.values():
        if "step" in param_state:
            param_state["step"] = param_state["step"].detach().clone()


_PATCHES = {
    "state_dict": _state_dict,
    "_set_main_param_and_optimizer_states": _set_main_param_and_optimizer_states,
    "load_state_dict": _load_state_dict,
}
