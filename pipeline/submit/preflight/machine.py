"""The machine a local run uses: the GPUs it asks for are there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import STAGES, spec
from pipeline.schema.layout import stage_plan
from pipeline.submit.preflight.checks import fail, reads

# ---------------------------------------------------------------------------- the machine a local run uses


def local_gpus(dev: Path = Path("/dev"), smi: str | None = "nvidia-smi") -> int | None:
    """GPUs this machine shows, without importing torch: NVIDIA's device files ``/dev/nvidia<N>``, else the
    lines of ``nvidia-smi -L`` (``smi``); None where a GPU may be there that neither counts (ROCm's
    ``/dev/kfd``, WSL's ``/dev/dxg``)."""
    found = sum(1 for p in dev.glob("nvidia*") if p.name[len("nvidia") :].isdigit())
    if found:
        return found
    if (dev / "kfd").exists() or (dev / "dxg").exists():
        return None
    exe = shutil.which(smi) if smi else None
    if exe is None:
        return 0
    try:
        r = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in r.stdout.splitlines() if ln.startswith("GPU ")) if r.returncode == 0 else 0


@reads(*STAGES)
def _local_gpus(cfg: PipelineConfig, stage: str) -> None:
    """``cluster.gpus_per_node`` > 0 with the local or debug executor: this machine has a GPU per rank of the
    stage (else its ranks would train on the CPU without a word). SLURM jobs run elsewhere: not checked."""
    c = cfg.cluster
    if c.executor == "slurm" or not spec(stage).torch:
        return
    want = stage_plan(cfg, stage).gpus_per_node
    have = local_gpus() if want else None
    if have is None or have >= want:
        return
    ranks = f"{want} ranks, each on its own GPU," if want > 1 else "its rank on a GPU"
    found = (
        f"{have} GPU{'s' if have > 1 else ''}" if have else "no GPU (no /dev/nvidia<N> device, no nvidia-smi)"
    )
    fail(
        "cluster.gpus_per_node",
        c.gpus_per_node,
        f"{stage} would run {ranks} on this machine (cluster.executor={c.executor}), which has {found}: set "
        "cluster.gpus_per_node=0 to train on the CPU, or submit to GPU nodes (cluster=slurm)",
    )
