"""Start-up of a stage's job: what megatron.core's import costs it (engine.runtime.distributed.import_megatron)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.env import REPO as ROOT
from tests.support.timing import scaled

_PROBE = """
import json, sys, torch
from engine.runtime import distributed as D
real = torch.compile
D.import_megatron()
from megatron.core.fusions import fused_bias_geglu as g
out = {
    "megatron": "megatron.core" in sys.modules,
    "dynamo": "torch._dynamo" in sys.modules,
    "wandb_during": "wandb" in sys.modules,
    "tensorboard_during": "torch.utils.tensorboard" in sys.modules,
    "compile_restored": torch.compile is real,
    "plain_function": not hasattr(g.geglu, "__wrapped__"),
}
try:
    import wandb  # noqa: F401  (hidden only while megatron imported)
    out["wandb_after"] = True
except ImportError as e:
    out["wandb_after"] = "hidden" not in str(e) and "None in sys.modules" not in str(e)
from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (the same)
print(json.dumps(out))
"""


def _probe(dynamo_disable: str) -> dict:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": dynamo_disable}
    r = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_megatron_skips_dynamo_and_hidden_packages() -> None:
    out = _probe("1")
    assert out["megatron"] and out["compile_restored"] and out["plain_function"]
    assert not out["dynamo"], "torch.compile under TORCHDYNAMO_DISABLE=1 imported torch._dynamo"
    assert not out["wandb_during"] and not out["tensorboard_during"]
    assert out["wandb_after"], "wandb stays importable after megatron's import"


def test_import_megatron_keeps_torch_compile_when_enabled() -> None:
    out = _probe("0")
    assert out["megatron"] and out["compile_restored"]
    assert out["dynamo"] and not out["plain_function"]  # megatron's helpers compiled as before
