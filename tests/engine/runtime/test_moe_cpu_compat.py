"""engine.runtime.cpu_compat's pieces for megatron's MoE path: the names megatron-core 0.16 leaves undefined
without Transformer Engine, the token dispatcher's event and its split sizes on CPU.

Patching happens only in a subprocess (never in the pytest process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from engine.runtime import cpu_compat
from tests.support.env import REPO
from tests.support.timing import scaled

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron.core.transformer.moe import moe_utils
    assert not hasattr(moe_utils, "te_general_gemm"), "megatron defines it now: drop MISSING_WITHOUT_TE"
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    try:
        moe_utils.router_gating_linear(x, w, None, torch.float32)
        raise SystemExit("the router's gating works without the fix: drop MISSING_WITHOUT_TE")
    except NameError:
        pass
    from engine.runtime import cpu_compat
    assert cpu_compat.define_missing_te_names() == ["megatron.core.transformer.moe.moe_utils.te_general_gemm"]
    assert cpu_compat.define_missing_te_names() == []  # idempotent
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    out.sum().backward()
    torch.testing.assert_close(out, x @ w.t())
    print("OK")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed")
def test_router_gating_runs_once_the_te_names_are_defined() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_dispatcher_split_sizes_become_numpy_on_cpu() -> None:
    calls = []

    def original(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
        calls.append(as_numpy)
        return tensor

    to_host = cpu_compat._to_host(original)
    sizes = to_host(torch.tensor([3, 5]), as_numpy=True)
    assert isinstance(sizes, np.ndarray) and sizes.tolist() == [3, 5] and not calls
    t = torch.tensor([1])
    assert to_host(t) is t and calls == [False]  # the rest: megatron's own


def test_no_stream_records_an_event_to_synchronize_on() -> None:
    event = cpu_compat._NoStream().record_event()
    assert isinstance(event, cpu_compat._NoStream)
    event.synchronize()
    assert cpu_compat._NoStream().query() is True
