"""Pre-flight of the eval stage's lm-eval tasks: ``eval.task_paths`` folders exist; every ``eval.tasks`` name is
one lm-eval knows (did-you-mean from its registry) and its data is there without network
(engine.evaluation.checks). Indexing lm-eval's bundled tasks takes ~25 s, so the names are checked only when
``eval.tasks`` is set."""

from __future__ import annotations

from pathlib import Path

from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.graph import LM_STAGES, TRAIN_STAGES
from pipeline.schema.stage_sections import OWN_LM_TASKS
from pipeline.submit.preflight.checks import fail, reads


@reads("eval")
def _lm_tasks(cfg: PipelineConfig, stage: str) -> None:
    ev = cfg.eval
    for i, p in enumerate(ev.task_paths):
        if not Path(p).expanduser().is_dir():
            fail(f"eval.task_paths[{i}]", p, "no such folder (a folder of lm-eval task YAML files)")
    if not ev.tasks:
        return
    if ev.apply_chat_template:
        _chat_templates(cfg)
    from engine.evaluation.checks import task_problems

    _first_problem(task_problems(list(ev.tasks), list(ev.task_paths), own=OWN_LM_TASKS))


@reads(*TRAIN_STAGES)
def _in_loop_tasks(cfg: PipelineConfig, stage: str) -> None:
    """``<stage>.eval_tasks``: lm-eval's names and offline data, as for eval.tasks; a language model."""
    st = cfg.stage(stage)
    assert isinstance(st, TrainStage)
    if not st.eval_tasks:
        return
    if stage not in LM_STAGES:
        fail(f"{stage}.eval_tasks", list(st.eval_tasks), f"{stage} is not a language model: no lm-eval tasks")
    for i, name in enumerate(st.eval_tasks):
        if name in OWN_LM_TASKS:
            fail(
                f"{stage}.eval_tasks[{i}]",
                name,
                "the run's own task runs in the eval stage: put it in eval.tasks",
            )
    from engine.evaluation.checks import task_problems

    _first_problem(task_problems(list(st.eval_tasks), list(cfg.eval.task_paths), f"{stage}.eval_tasks"))


def _first_problem(problems: list[tuple[str, str, str]]) -> None:
    if problems:
        key, value, why = problems[0]
        fail(key, value, why + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _chat_templates(cfg: PipelineConfig) -> None:
    """eval.apply_chat_template: every hf:<dir> model of eval.models has its own chat template (the run's
    stages use data.chat_template, which always has one)."""
    from engine.evaluation.load import has_chat_template
    from pipeline.schema.hf_arch import parse_ref

    for i, m in enumerate(cfg.eval.models):
        hf_dir = parse_ref(m) if m.startswith("hf:") else None
        if hf_dir is not None and not has_chat_template(hf_dir):
            fail(
                f"eval.models[{i}]",
                m,
                f"{hf_dir} has no chat template (chat_template.jinja or tokenizer_config.json's chat_template) "
                "and eval.apply_chat_template=true: add one to that directory, leave the model out of "
                "eval.models or set eval.apply_chat_template=false",
            )
