"""The stage modules, one per stage declared in pipeline.schema.graph, each with ``main(cfg, ctx) -> outputs``.

``entry(stage)`` imports the module ``stages.<stage>`` (``module(stage)``; a job imports only its own stage) and
returns its ``main``: a stage is declared once, in the graph, and found here by its name. The import stays inside this
package, so no layer is crossed (tests/test_layering.py checks where names are imported).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.schema.graph import STAGES

if TYPE_CHECKING:
    from engine.context import StageContext
    from pipeline.schema.config import PipelineConfig

StageMain = Callable[["PipelineConfig", "StageContext"], dict[str, Any]]
"""A stage's ``main(cfg, ctx)``: runs on every rank of the stage's job, returns rank 0's outputs."""


def module(stage: str) -> str:
    """The module of the declared ``stage``, ``stages.<stage>`` (named without importing it: prefork preloads it)."""
    if stage not in STAGES:
        raise KeyError(f"stage {stage!r} is not declared in pipeline.schema.graph (declared: {list(STAGES)})")
    return f"{__name__}.{stage}"


def entry(stage: str) -> StageMain:
    """The ``main(cfg, ctx)`` of the declared ``stage`` (imports ``stages.<stage>``)."""
    main: StageMain = importlib.import_module(module(stage)).main
    return main
