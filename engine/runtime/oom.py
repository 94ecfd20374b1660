"""On a CUDA out-of-memory error: the allocator's summary and the planner's estimate next to the error.

``with oom_report(cfg, ctx, metrics): trainer.fit()`` catches ``torch.cuda.OutOfMemoryError``, writes
``<stage dir>/oom_rank<r>.txt`` (``torch.cuda.memory_summary()``, the planner's per-GPU estimate for this
layout and the cheapest change of layout that fits, ``pipeline.schema.estimates.suggest_fix``), logs where it is,
adds an ``oom`` alarm line to metrics.jsonl (rank 0) and re-raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.context import MetricsWriter, StageContext
from pipeline.schema.config import PipelineConfig

log = logging.getLogger(__name__)
GiB = 1024**3


def planner_lines(cfg: PipelineConfig, stage: str) -> list[str]:
    """The planner's estimate for the stage's layout and its cheapest fitting change."""
    from pipeline.schema.estimates import estimate_stage, suggest_fix

    try:
        est = estimate_stage(cfg, stage)
        fix = est.suggestion or suggest_fix(cfg, stage)
    except Exception as e:  # the report must not hide the OOM behind a planner error
        return [f"planner estimate unavailable: {type(e).__name__}: {e}"]
    cap = f"{est.capacity / GiB:.1f} GiB usable" if est.capacity else "capacity unknown"
    return [
        f"planner estimate: {est.peak_bytes / GiB:.1f} GiB per GPU at pipeline rank {est.peak.pp_rank} ({cap})",
        f"cheapest change of layout that fits: {fix or 'none found'}",
    ]


def format_oom(error: BaseException, summary: str, planner: list[str], stage: str) -> str:
    return "\n".join(
        [f"{stage}: CUDA out of memory: {error}", "", *planner, "", "torch.cuda.memory_summary():", summary]
    )


@contextmanager
def oom_report(
    cfg: PipelineConfig,
    ctx: StageContext,
    metrics: MetricsWriter,
    rank: int | None = None,
    summary: Callable[[], str] | None = None,
    oom_type: Any = None,
) -> Iterator[None]:
    import torch

    oom = oom_type or torch.cuda.OutOfMemoryError
    try:
        yield
    except oom as e:
        if rank is None:
            from engine.runtime import distributed as D

            rank = D.rank()
        text = format_oom(
            e, (summary or torch.cuda.memory_summary)(), planner_lines(cfg, ctx.stage), ctx.stage
        )
        path = Path(ctx.out_dir) / f"oom_rank{rank}.txt"
        path.write_text(text + "\n")
        log.error("CUDA out of memory; allocator summary and planner estimate in %s", path)
        fix = next((line for line in text.splitlines() if line.startswith("cheapest")), "")
        metrics.write(
            {"kind": "alarm", "alarm": "oom", "step": None, "message": f"out of memory ({path}); {fix}"}
        )
        raise
