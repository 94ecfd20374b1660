"""A MoE run killed from outside at EP2 resumes at EP1: weights, Adam state and data position continue.

Run A trains at EP2 (2 ranks, dp2) and is SIGKILLed once its step-4 checkpoint is complete, mid-run. Run B
resumes on one rank (EP1) from A's checkpoint root as the kill left it; run C resumes on one rank from a copy
of only the checkpoint B resumed from and is not interrupted. Required: B's state right after loading
equals A's at that save bit for bit (by global parameter name: experts by global expert index), B equals C
bit for bit (history and final state), and B's steps match an uninterrupted EP2 run D within the layout
tolerance (the optimizer state and the data position carried over; tests/support/resume_drill.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.env import REPO, module_command, rank_env
from tests.support.metrics import FP32_REL, max_rel_delta
from tests.support.resume_drill import assert_same_tensors, launch
from tests.support.timing import scaled

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32}
MOE = {**MODEL, "num_experts": 4, "moe_router_topk": 2, "moe_z_loss_coeff": 1e-3}
EP2 = {"global_batch_size": 8, "micro_batch_size": 2, "dp": 2, "ep": 2}
EP1 = {"global_batch_size": 8, "micro_batch_size": 2}
KILL_AFTER = 4
"""A is killed once this step's checkpoint is complete and a later step has ended (the drill's snapshots of
the save written)."""


def run_and_kill(world: int, spec: dict[str, Any], tmp: Path, deadline_s: float = scaled(300)) -> int:
    """Start ``world`` drill ranks, SIGKILL them all once ``root/iter_<KILL_AFTER>`` is complete and a later
    step has ended; returns the last step the metrics show before the kill (the run must not have finished)."""
    from engine.checkpoint.layout import MARKER, iter_dir_name
    from engine.runtime.distributed import free_port

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "spec.json").write_text(json.dumps({**spec, "out": str(tmp / "result.json")}))
    port, procs = free_port(), []
    script = REPO / "tests" / "support" / "resume_drill.py"
    for rank in range(world):
        env = rank_env(rank, world, port, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, *module_command(script), str(tmp / "spec.json")]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
    marker = Path(spec["root"]) / iter_dir_name(KILL_AFTER) / MARKER
    end = time.monotonic() + deadline_s
    try:
        while (
            not (marker.exists() and _last_step(Path(spec["metrics"])) > KILL_AFTER)
            and time.monotonic() < end
            and all(p.poll() is None for p, _ in procs)
        ):
            time.sleep(0.05)
    finally:
        for p, log in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
            log.close()
    assert marker.exists(), (tmp / "rank0.log").read_text()[-3000:]
    last = _last_step(Path(spec["metrics"]))
    assert KILL_AFTER < last < spec["iters"], "the run ended before it was killed"
    return last


def _last_step(metrics: Path) -> int:
    """The last step of a complete train line of metrics.jsonl (0: none yet)."""
    if not metrics.exists():
        return 0
    steps = [0]
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("kind") == "train":
            steps.append(int(record["step"]))
    return max(steps)


def merged(dump: Path, name: str, world: int) -> dict[str, Any]:
    """The global snapshots of every rank as one (replicated tensors: rank 0's)."""
    import torch

    out: dict[str, Any] = {}
    for rank in reversed(range(world)):
        out |= torch.load(dump / f"{name}.rank{rank}.pt")
    return out


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_killed_at_ep2_resumes_at_ep1_exactly(tmp_path: Path) -> None:
    import torch

    from engine.checkpoint.latest import find_latest

    a_root = tmp_path / "a" / "checkpoints"
    a = {"model": MOE, "parallel": EP2, "iters": 40, "global_dump": True}
    a |= {
        "root": str(a_root),
        "dump": str(tmp_path / "a" / "dump"),
        "metrics": str(tmp_path / "a" / "m.jsonl"),
    }
    reached = run_and_kill(2, a, tmp_path / "a")
    latest = find_latest(a_root)
    assert latest is not None
    step = int(latest.name.split("_")[1])
    print(f"\nA killed after step {reached}; newest complete checkpoint: step {step}")

    iters = step + 2
    b_root = tmp_path / "b" / "checkpoints"
    shutil.copytree(a_root, b_root)
    base = {"model": MOE, "parallel": EP1, "iters": iters, "global_dump": True}
    b = launch(1, {**base, "root": str(b_root), "dump": str(tmp_path / "b" / "dump")}, tmp_path / "b")
    c_root = tmp_path / "c" / "checkpoints"
    shutil.copytree(latest, c_root / latest.name)
    c = launch(1, {**base, "root": str(c_root), "dump": str(tmp_path / "c" / "dump")}, tmp_path / "c")
    assert b["resumed_from"] == c["resumed_from"] == step

    saved = merged(tmp_path / "a" / "dump", f"gsave{step}", 2)
    loaded = merged(tmp_path / "b" / "dump", "gloaded", 1)
    assert sorted(saved) == sorted(loaded)
    assert any(".local_experts.3." in k and k.startswith("opt.") for k in loaded), sorted(loaded)[:20]
    differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert not differ, f"state after the EP2 -> EP1 load differs from the EP2 save in {differ[:5]}"

    assert b["history"] == c["history"], "the resumed run differs from an uninterrupted one"
    assert_same_tensors(
        tmp_path / "b" / "dump" / f"gsave{iters}.rank0.pt", tmp_path / "c" / "dump" / f"gsave{iters}.rank0.pt"
    )

    d_root = tmp_path / "d" / "checkpoints"
    shutil.copytree(latest, d_root / latest.name)
    d = launch(
        2,
        {**base, "parallel": EP2, "root": str(d_root), "dump": str(tmp_path / "d" / "dump")},
        tmp_path / "d",
    )
    for key in ("loss", "grad_norm"):
        got, want = [h[key] for h in b["history"]], [h[key] for h in d["history"]]
        assert max_rel_delta(got, want) < FP32_REL, (key, got, want)
