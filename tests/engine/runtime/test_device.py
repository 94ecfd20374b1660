"""Device discipline: every batch the engine, eval and the steps feed the model is on the model's device.

``engine.runtime.distributed.device()`` decides the device. Here it is pointed at ``meta`` and the model is
moved there; a forward pre-hook on the GPTModel records the devices of every tensor argument and stops the
call (nothing is computed). A tensor made on the CPU anywhere on the way (eval's batches, positions,
generation's token rows, a step's batch) shows up as ``cpu`` and fails the test, as it would fail on CUDA.
The same run checks bf16: bf16 weights, fp32 gradient buffers, fp32 main params in the optimizer. The static
test keeps ``.cuda(`` and ``"cuda"`` devices out of ``stages/`` except in the device helper and cpu_compat.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.env import REPO
from tests.support.timing import scaled

SCRIPT = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace

    import numpy as np
    import torch

    from pipeline.schema.config import ModelConfig, TrainStage
    from pipeline.schema.sections import ParallelConfig
    from stages import eval as ev
    from engine.runtime import distributed as D
    from engine.models.gpt import build_model, unwrap
    from engine.train.steps import make_step
    from tests.support.synthetic import SyntheticPreferenceSource, SyntheticSource
    from engine.rl.dpo import DPOStep, WithReference, reference_logps
    from engine.train.optimizer import build_optimizer
    from engine.train.trainer import Trainer

    D.init(1, 1, seed=1, threads=1)
    seq, vocab = 16, 64
    model_cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=seq)
    par = ParallelConfig(micro_batch_size=2, global_batch_size=2)
    stage = TrainStage(parallel=par, iters=1, warmup_iters=0, threads=1, eval_iters=1)
    chunks = build_model(model_cfg, par, vocab)
    assert {p.device for p in chunks[0].parameters()} == {D.device()}, "build_model: not on D.device()"
    optimizer, scheduler = build_optimizer(chunks, stage, par)
    gpt = unwrap(chunks[0])

    # bf16: bf16 weights, fp32 gradient buffers and fp32 main params in the optimizer.
    par16 = ParallelConfig(micro_batch_size=2, global_batch_size=2, precision="bf16")
    bf16 = build_model(model_cfg, par16, vocab)
    opt16, _ = build_optimizer(bf16, TrainStage(parallel=par16, iters=1, warmup_iters=0), par16)
    dtypes = {
        "params": sorted({str(p.dtype) for p in bf16[0].parameters()}),
        "grad_buffers": sorted({str(b.grad_dtype) for b in bf16[0].buffers}),
        "main_params": sorted({str(p.dtype) for g in opt16.param_groups for p in g["params"]}),
    }

    class Landed(Exception):
        pass

    def hook(module, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        raise Landed(sorted({str(t.device) for t in tensors}), str(next(module.parameters()).device))

    gpt.register_forward_pre_hook(hook, with_kwargs=True)
    fake = torch.device("meta")
    gpt.to(fake)
    D.device = lambda: fake  # the helper decides; everything must follow it

    def landed(fn):
        try:
            fn()
        except Landed as e:
            return {"inputs": e.args[0], "model": e.args[1]}
        return {"inputs": [], "model": "never called"}

    text = SyntheticSource(8, vocab, seq, seed=1)
    prefs = SyntheticPreferenceSource(8, vocab, seq, seed=1)
    with_ref = WithReference(prefs, np.zeros((8, 2)), 0)

    def train(step, source):
        t = Trainer(chunks, optimizer, scheduler, step, stage=stage, seq_length=seq, train_source=source,
                    valid_source=source)
        return t

    class Tok:
        pad, eod, vocab_size = 1, 0, vocab
        def encode(self, text):
            return [5, 6, 7]
        def decode(self, ids):
            return ""

    cfg = SimpleNamespace(eval=SimpleNamespace(batch_size=2, max_new_tokens=2),
                          model=SimpleNamespace(seq_length=seq))
    empty = {"valid": [], "pref": [], "task": []}
    out = {
        "pretrain_step": landed(lambda: train(make_step("pretrain"), text).train_step(0)),
        "sft_step": landed(lambda: train(make_step("sft"), text).train_step(0)),
        "dpo_step": landed(lambda: train(DPOStep(), with_ref).train_step(0)),
        "validation": landed(lambda: train(make_step("pretrain"), text).evaluate()),
        "dpo_reference": landed(lambda: reference_logps(chunks, prefs, first_step=0, steps=1, stage=stage,
                                                        seq_length=seq)),
        "eval_perplexity": landed(lambda: ev.evaluate([gpt], Tok(), {**empty, "valid": [text[0], text[1]]}, cfg)),
        "eval_preference": landed(lambda: ev.evaluate([gpt], Tok(), {**empty, "pref": [prefs[0]]}, cfg)),
        "eval_generation": landed(
            lambda: ev.evaluate([gpt], Tok(), {**empty, "task": [{"prompt": "p", "answer": "a"}]}, cfg)
        ),
    }
    print("DTYPES", json.dumps(dtypes))
    print("RESULT", json.dumps(out))
    """
)


def test_every_batch_lands_on_the_models_device(tmp_path: Path) -> None:
    script = tmp_path / "device_check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=scaled(300), env=env, cwd=REPO
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    seen = json.loads(line[len("RESULT ") :])
    assert len(seen) == 8
    for path, got in seen.items():
        assert got == {"inputs": ["meta"], "model": "meta"}, (path, got)
    line = next(x for x in r.stdout.splitlines() if x.startswith("DTYPES "))
    assert json.loads(line[len("DTYPES ") :]) == {
        "params": ["torch.bfloat16"],
        "grad_buffers": ["torch.float32"],
        "main_params": ["torch.float32"],
    }


# Files allowed to name CUDA: the device helper (and process-group set-up) and the CPU compatibility layer.
ALLOWED = {"engine/runtime/distributed.py", "engine/runtime/cpu_compat.py"}
FORBIDDEN = re.compile(
    r"""\.cuda\(|device\s*=\s*["']cuda|torch\.device\(\s*["']cuda|\.to\(\s*["']cuda|torch\.cuda\.current_device\("""
)


def test_nothing_else_in_stages_names_cuda() -> None:
    offenders = []
    for path in sorted((REPO / "stages").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "use engine.runtime.distributed.device() instead:\n" + "\n".join(offenders)


def test_attention_falls_back_to_the_local_spec_without_transformer_engine() -> None:
    import importlib.util

    from engine.models.gpt import attention_impl

    assert attention_impl() == ("te" if importlib.util.find_spec("transformer_engine") else "local")


def test_gpu_check_without_a_gpu_says_so_and_skips_every_gpu_test(tmp_path: Path) -> None:
    """scripts/gpu-check.sh on a machine without CUDA (CUDA_VISIBLE_DEVICES hides any): exit 0, all skipped."""
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (tmp_path / "gpu-check.log").read_text()
    assert "no CUDA GPU here" in log and "0 GPU tests run" in log, log[-2000:]
    summary = re.search(r"(\d+) skipped", log)
    assert summary and int(summary.group(1)) >= 6 and " passed" not in log and " failed" not in log, log[
        -2000:
    ]
