"""Pre-flight of the eval stage's lm-eval tasks: ``eval.task_paths`` folders exist; every ``eval.tasks`` name is
one lm-eval knows (did-you-mean from its registry) and its data is there without network
(engine.evaluation.checks). Indexing lm-eval's bundled tasks takes ~25 s, so the names are checked only when
``eval.tasks`` is set."""

from __future__ import annotations

from pathlib import Path

from pipeline.schema.config import PipelineConfig
from pipeline.submit.preflight.checks import fail, reads


@reads("eval")
def _lm_tasks(cfg: PipelineConfig, stage: str) -> None:
    ev = cfg.eval
    for i, p in enumerate(ev.task_paths):
        if not Path(p).expanduser().is_dir():
            fail(f"eval.task_paths[{i}]", p, "no such folder (a folder of lm-eval task YAML files)")
    if not ev.tasks:
        return
    if ev.parallel.pp > 1:
        fail(
            "eval.parallel.pp",
            ev.parallel.pp,
            "lm-eval tasks (eval.tasks) run with pp=1 (tensor parallel is fine)",
        )
    from engine.evaluation.checks import task_problems

    problems = task_problems(list(ev.tasks), list(ev.task_paths))
    if problems:
        key, value, why = problems[0]
        fail(key, value, why + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
