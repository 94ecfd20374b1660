"""engine.runtime.cpu_compat: the patch table still matches torch/megatron, and the patches work.

Patching happens only in subprocesses (never in the pytest process).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.runtime import cpu_compat
from tests.support.env import REPO as ROOT
from tests.support.timing import scaled

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_compat is inactive with CUDA")
FACTORY_ARGS: dict[str, tuple[object, ...]] = {
    "tensor": ([1],),
    "as_tensor": ([1],),
    "full": ((2,), 1.0),
    "randint": (5, (2,)),
}


@pytest.mark.parametrize("patch", cpu_compat.PATCHES, ids=lambda p: f"{p.owner}.{p.name}")
def test_patched_symbol_still_exists_with_same_parameters(patch: cpu_compat.Patch) -> None:
    assert not cpu_compat.installed(), "cpu_compat leaked into the pytest process"
    owner = cpu_compat.resolve(patch.owner)
    assert hasattr(owner, patch.name), f"{patch.owner}.{patch.name} disappeared: update cpu_compat.PATCHES"
    original = getattr(owner, patch.name)
    if patch.params is not None:
        params = tuple(inspect.signature(original).parameters)
        assert params == patch.params, (
            f"{patch.owner}.{patch.name} now takes {params}, cpu_compat expects {patch.params}: "
            "check the replacement still fits and update cpu_compat.PATCHES"
        )
    if patch.owner == "torch":  # factories: still take a device keyword
        args = FACTORY_ARGS.get(patch.name, (2,))
        assert original(*args, device="cpu").device.type == "cpu"


def test_megatron_still_needs_the_rng_patch() -> None:
    """If megatron stops calling these, the corresponding patch can go."""
    from megatron.core.tensor_parallel import random as mrandom

    source = inspect.getsource(mrandom)
    assert "torch.cuda.get_rng_state()" in source
    assert "_set_cuda_rng_state(" in source


SCRIPT = textwrap.dedent(
    """
    import torch
    from engine.runtime import cpu_compat as c

    originals = {(p.owner, p.name): getattr(c.resolve(p.owner), p.name) for p in c.PATCHES}
    assert c.install() is True and c.install() is True  # idempotent
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    s = torch.cuda.Stream(device=torch.cuda.current_device())
    s.wait_stream(torch.cuda.default_stream()); torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(s):
        pass
    e = torch.cuda.Event(enable_timing=True); e.record(); e.synchronize()
    for f in (torch.zeros, torch.ones, torch.empty):
        assert f(3, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.full((2,), 1.0, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.arange(3, device=0).device.type == "cpu"
    t = torch.ones(2)
    assert t.cuda() is t and t.to("cuda").device.type == "cpu" and t.to(device="cuda:0").device.type == "cpu"
    assert t.to(torch.float16).dtype == torch.float16
    assert t.type() == "torch.cuda.FloatTensor"
    assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.type("torch.cuda.HalfTensor").dtype == torch.float16
    assert t.type(torch.float64).dtype == torch.float64

    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(before, torch.get_rng_state()), "fork must restore the default generator"
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    with tracker.fork():
        b = torch.rand(4)
    assert torch.equal(a, b), "the tracker must be reproducible from the seed"
    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=1, ep_rank=0, etp_rank=0)
    with tracker.fork():
        assert not torch.equal(a, torch.rand(4)), "tensor-parallel ranks need different streams"

    c.uninstall()
    for (owner, name), orig in originals.items():
        assert getattr(c.resolve(owner), name) is orig, (owner, name)
    assert torch.ones(1).type() == "torch.FloatTensor"
    print("OK")
    """
)


def test_install_patches_and_uninstall_restores() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_logits_max_by_amax_equals_megatrons() -> None:
    """The speed patch of the cross entropy's maximum returns megatron's values exactly (also for inf/NaN)."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    logits = torch.randn(16, 4, 257, dtype=torch.bfloat16)
    logits[0, 0, 3], logits[1, 2, 7], logits[2, 1, :] = float("inf"), float("nan"), float("-inf")
    ref_logits, ref_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
    got_logits, got_max = cpu_compat._logits_max(logits)
    assert got_logits.dtype == ref_logits.dtype == torch.float32
    torch.testing.assert_close(got_logits, ref_logits, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_max, ref_max, rtol=0, atol=0, equal_nan=True)
    assert got_max.isnan().any() and got_max.isinf().any()
