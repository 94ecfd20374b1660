"""lm-eval tasks on the engine backend: one ``simple_evaluate`` per model, its results reduced to what the eval
stage records (per task: metric values with lm-eval's standard errors, the task's version and config hash, the
few-shot seed and count, the number of documents) and, on request, the sample-level logs as JSON lines."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TaskRun:
    """What to run (the eval stage's ``eval.tasks`` keys)."""

    tasks: list[Any]
    """Task names, or lm-eval task configs (dicts: a task the caller defines, e.g. the eval stage's own)."""
    task_paths: list[str] = field(default_factory=list)
    """lm-eval include paths: folders of users' task YAMLs."""
    num_fewshot: int | None = None
    """None: each task's own default."""
    limit: int | None = None
    """Documents per task (None: all)."""
    fewshot_seed: int = 1234
    log_samples: bool = False
    apply_chat_template: bool = False
    """Prompts rendered with the model's chat template (the backend's ``apply_chat_template``)."""
    fewshot_as_multiturn: bool = True


def task_manager(task_paths: list[str], tasks: list[str] | None = None) -> Any:
    """lm-eval's TaskManager with the users' folders ``task_paths``. Indexing lm-eval's bundled tasks takes
    ~25 s, so it is left out when every name of ``tasks`` is a plain task (not a group or tag, whose members
    may be bundled ones) defined under ``task_paths``."""
    from lm_eval.tasks import TaskManager

    if tasks is not None and not tasks:  # only tasks given as configs: nothing to index
        return TaskManager(include_path=list(task_paths) or None, include_defaults=False)
    if task_paths and tasks:
        own = TaskManager(include_path=list(task_paths), include_defaults=False)
        if set(tasks) <= set(own.all_subtasks):
            return own
    return _full_manager(tuple(task_paths))


@functools.cache
def _full_manager(task_paths: tuple[str, ...]) -> Any:
    """The bundled tasks and ``task_paths`` indexed once per process (pre-flight and tests ask again)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(task_paths) or None)


def run_tasks(lm: Any, run: TaskRun, manager: Any, samples_dir: Path | None = None) -> dict[str, Any]:
    """``{task: section}`` for ``lm`` (an lm-eval LM) on ``run.tasks`` (see :func:`summarize`); with
    ``run.log_samples`` and ``samples_dir``, each task's samples go to ``<samples_dir>/<task>.jsonl``."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(
        model=lm,
        tasks=list(run.tasks),
        num_fewshot=run.num_fewshot,
        limit=run.limit,
        log_samples=run.log_samples,
        task_manager=manager,
        fewshot_random_seed=run.fewshot_seed,
        apply_chat_template=run.apply_chat_template,
        fewshot_as_multiturn=run.fewshot_as_multiturn and run.apply_chat_template,
    )
    if out is None:  # only on ranks other than lm's rank 0; every rank here is lm-eval's rank 0
        return {}
    if run.log_samples and samples_dir is not None:
        write_samples(samples_dir, out.get("samples", {}))
    return summarize(out, run)


def summarize(out: dict[str, Any], run: TaskRun) -> dict[str, Any]:
    """Per task (and group) of lm-eval's results: ``{"metrics": {name: {"value", "stderr"}}, "version",
    "config_hash", "num_fewshot", "fewshot_seed", "chat_template", "samples"}``; a metric under a filter other than ``none`` is
    named ``<metric>,<filter>``; stderr is None where lm-eval gives none."""
    sections: dict[str, Any] = {}
    for task, res in out["results"].items():
        metrics: dict[str, dict[str, Any]] = {}
        for key, value in res.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            stderr = res.get(f"{metric}_stderr,{filt}")
            metrics[metric if filt == "none" else key] = {
                "value": _number(value),
                "stderr": _number(stderr),
            }
        config = out.get("configs", {}).get(task)
        n = out.get("n-samples", {}).get(task, {})
        sections[task] = {
            "metrics": metrics,
            "version": out.get("versions", {}).get(task),
            "config_hash": config_hash(config) if config is not None else None,
            "num_fewshot": out.get("n-shot", {}).get(task, run.num_fewshot),
            "fewshot_seed": run.fewshot_seed,
            "chat_template": run.apply_chat_template,
            "samples": n.get("effective"),
        }
    return sections


def metric_fields(section: dict[str, Any]) -> dict[str, Any]:
    """A task section's metrics as one metrics.jsonl line's fields: ``<metric>`` and ``<metric>_stderr``."""
    values = {k: m["value"] for k, m in section["metrics"].items()}
    return {**values, **{f"{k}_stderr": m["stderr"] for k, m in section["metrics"].items()}}


def config_hash(config: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of the task's resolved config as lm-eval reports it."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=_stable).encode()).hexdigest()[:16]


def _stable(value: Any) -> str:
    """A config value JSON has no form for: a function by its qualified name (its repr holds an address)."""
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def write_samples(out_dir: Path, samples: dict[str, list[dict[str, Any]]]) -> None:
    """One JSON line per document per task (lm-eval's sample records)."""
    from pipeline.records.files import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    for task, rows in samples.items():
        text = "".join(json.dumps(r, default=str) + "\n" for r in rows)
        atomic_write_text(out_dir / f"{task}.jsonl", text)
