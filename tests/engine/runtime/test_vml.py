"""engine.runtime.vml: a rank's first multi-threaded ``torch.exp`` equals its second (MKL VML's first-call race).

The race needs a fresh process each time (the dispatch is resolved once per process), so each case runs
the probe below in new subprocesses, two at a time: two threads busy with GEMMs and softmaxes first (as a
rank is after generation), then ``exp`` over a [4, 32, 512] block twice. Without the warm-up about one probe
in three came back with half its elements different here; through ``engine.runtime.distributed.init`` (which
warms) every probe must be clean. The cold count is printed, not asserted (a race may hide on a given run).
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.runtime import vml
from tests.support.env import REPO as ROOT
from tests.support.env import rank_env
from tests.support.timing import scaled

PROBES = 10

_PROBE = """
import sys, torch
if sys.argv[1] == "init":
    from engine.runtime import distributed as D
    D.init(threads=2)
else:
    torch.set_num_threads(2)
a = torch.randn(512, 512)
for _ in range(20):
    (a @ a).add_(1).softmax(-1)
y = torch.randn(4, 32, 512, generator=torch.Generator().manual_seed(0)) * 3
y -= torch.amax(y, -1, keepdim=True)
first, second = torch.exp(y), torch.exp(y)
if sys.argv[1] == "init":
    D.shutdown()
print(int((first != second).sum()))
"""


def _probe(how: str) -> int:
    # one rank on its own port, whatever job (torchrun, SLURM) the suite itself runs in
    env = rank_env(0, 1, OMP_NUM_THREADS="2")
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, how],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def _probes(how: str) -> list[int]:
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(_probe, [how] * PROBES))


def test_warm_calls_every_op_on_one_thread_in_both_precisions(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, torch.dtype, int]] = []
    for name in vml.OPS:
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda x, _n=name, _f=real: (seen.append((_n, x.dtype, x.numel())), _f(x))[1]
        )
    vml.warm()
    assert {(n, d) for n, d, _ in seen} == {(n, d) for n in vml.OPS for d in (torch.float32, torch.float64)}
    assert all(size < 2048 for *_, size in seen)  # below ATen's grain: the calling thread alone
    assert {"exp", "log", "tanh", "sqrt", "sin", "cos"} <= set(vml.OPS)  # what the engine's math calls


@pytest.mark.slow
def test_first_exp_of_a_rank_equals_the_second() -> None:
    cold = _probes("cold")
    warm = _probes("init")
    print(f"first exp differed from the second in {sum(c > 0 for c in cold)} of {PROBES} cold probes")
    assert warm == [0] * PROBES, f"after distributed.init: {warm} (cold: {cold})"
