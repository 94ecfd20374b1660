"""Subprocess worker: one rank of the eval stage (``stages.eval.main``) on an existing run directory.

SPEC keys: overrides (Hydra overrides composing the run's config), run_dir, out_dir, out (set by launch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    from engine.context import StageContext
    from pipeline.schema.compose import load_config
    from pipeline.schema.layout import stage_plan
    from stages import eval as eval_stage

    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = load_config(spec["overrides"])
    run_dir = Path(spec["run_dir"])
    ctx = StageContext(
        run_dir=run_dir,
        stage="eval",
        out_dir=Path(spec["out_dir"]),
        inputs={s: run_dir / "stages" / s for s in ("data_prep", "pretrain", "sft")},
        plan=stage_plan(cfg, "eval"),
    )
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    eval_stage.main(cfg, ctx)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["out"]).write_text((ctx.out_dir / "results.json").read_text())
