"""Export (opt-in: list ``export`` in run.stages): the last step of the graph, ``python -m pipeline.export``.

Runs the export command on the run directory for ``export.stage`` (default: the last of pretrain, sft, rlhf
in run.stages) in a child process, so the stage uses exactly the public command (its Hugging Face directory,
its logit check, its ``export`` event and ``extra.export`` in the exported stage's ledger record). The check's
result is this stage's output (its ledger record's ``outputs``); a failed check fails the stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from engine.context import StageContext
from pipeline.schema.config import PipelineConfig
from pipeline.schema.graph import export_source


def command(cfg: PipelineConfig, ctx: StageContext) -> list[str]:
    """The export command this stage runs."""
    ex = cfg.export
    cmd = [sys.executable, "-m", "pipeline.export", str(ctx.run_dir), export_source(cfg)]
    if ex.out:
        cmd += ["--out", ex.out]
    if ex.tolerance is not None:
        cmd += ["--tolerance", repr(ex.tolerance)]
    return cmd


def main(cfg: PipelineConfig, ctx: StageContext) -> dict[str, Any]:
    if ctx.rank != 0:
        return {}
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.export.threads)}
    proc = subprocess.run(command(cfg, ctx), capture_output=True, text=True, env=env, check=False)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RuntimeError(f"export of {export_source(cfg)} failed (exit {proc.returncode}): {last}")
    out = proc.stdout
    start = out.rfind("\n{\n") + 1 if "\n{\n" in out else out.index("{")  # the command's JSON, printed last
    result: dict[str, Any] = json.loads(out[start:])
    print(json.dumps(result, indent=2), flush=True)
    return {"stage": export_source(cfg), **result}
