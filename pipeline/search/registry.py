"""The search's seams: samplers, pruners and objectives by name (the schema's names: pipeline.schema.search).

A sampler factory takes the search config and the space; a pruner factory the search config and the prune
stage's iterations (the last rung); an objective reads a finished trial's score from its run directory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.schema import search as schema
from pipeline.schema.config import PipelineConfig, TrainStage
from pipeline.schema.errors import ConfigError
from pipeline.search.space import Space


def _tpe(sc: Any, space: Space) -> Any:
    import optuna

    return optuna.samplers.TPESampler(seed=sc.seed, constant_liar=True)  # liar: in-flight trials spread out


def _random(sc: Any, space: Space) -> Any:
    import optuna

    return optuna.samplers.RandomSampler(seed=sc.seed)


def _grid(sc: Any, space: Space) -> Any:
    import optuna

    class Grid(optuna.samplers.GridSampler):
        """GridSampler without its Study.stop() once every point is asked (valid only inside optimize(); the
        controller stops at search.n_trials itself)."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return Grid(space.grid(), seed=sc.seed)


def _cmaes(sc: Any, space: Space) -> Any:
    import optuna

    return optuna.samplers.CmaEsSampler(seed=sc.seed, warn_independent_sampling=False)


SAMPLERS: dict[str, Callable[[Any, Space], Any]] = {
    "tpe": _tpe,
    "random": _random,
    "grid": _grid,
    "cmaes": _cmaes,
}


def _none(sc: Any, iters: int) -> Any:
    import optuna

    return optuna.pruners.NopPruner()


def _median(sc: Any, iters: int) -> Any:
    import optuna

    return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=sc.warmup_steps)


def _asha(sc: Any, iters: int) -> Any:
    import optuna

    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=sc.min_resource or "auto", reduction_factor=sc.reduction_factor
    )


def _hyperband(sc: Any, iters: int) -> Any:
    import optuna

    return optuna.pruners.HyperbandPruner(
        min_resource=sc.min_resource or 1, max_resource=iters, reduction_factor=sc.reduction_factor
    )


PRUNERS: dict[str, Callable[[Any, int], Any]] = {
    "none": _none,
    "median": _median,
    "asha": _asha,
    "successive_halving": _asha,
    "hyperband": _hyperband,
}


def _points(metrics: Path, kind: str, key: str, **match: Any) -> list[tuple[int, float]]:
    """(step, ``key``) of every ``kind`` line of a stage's metrics.jsonl holding ``match`` and a finite number
    under ``key`` (a line being written is skipped)."""
    out: list[tuple[int, float]] = []
    if not metrics.is_file():
        return out
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        v = m.get(key)
        if m.get("kind") != kind or any(m.get(k) != want for k, want in match.items()):
            continue
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out.append((int(m["step"]), float(v)))
    return out


def valid_losses(metrics: Path) -> list[tuple[int, float]]:
    """(step, loss) of every valid line of a stage's metrics.jsonl."""
    return _points(metrics, "valid", "loss")


def task_values(metrics: Path, task: str, metric: str) -> list[tuple[int, float]]:
    """(step, value) of ``metric`` in every in-training ``eval_task`` line of ``task`` (engine.train.trainer)."""
    return _points(metrics, "eval_task", metric, task=task)


def prune_points(sc: Any, metrics: Path) -> list[tuple[int, float]]:
    """What the pruner compares at each rung of ``sc.prune_stage`` (metrics: its metrics.jsonl), in the study's
    direction: the objective's own in-training task values when it is a task of that stage, else valid losses
    (negated for a ``maximize`` study, where higher must mean better)."""
    in_loop = schema.task_objective(sc.objective)
    if in_loop is not None and in_loop[0] == sc.prune_stage:
        return task_values(metrics, in_loop[1], in_loop[2])
    sign = -1.0 if sc.direction == "maximize" else 1.0
    return [(step, sign * loss) for step, loss in valid_losses(metrics)]


def _final(points: list[tuple[int, float]]) -> float | None:
    return points[-1][1] if points else None


def _best(points: list[tuple[int, float]]) -> float | None:
    return min(v for _, v in points) if points else None


STAGE_OBJECTIVES: dict[str, Callable[[list[tuple[int, float]]], float | None]] = {
    "final_valid_loss": _final,
    "best_valid_loss": _best,
}


def objective_value(objective: str, run_dir: Path) -> float | None:
    """The score of a finished trial (None: its run directory holds no such value)."""
    stage, _, name = objective.partition(".")
    if stage == "eval":
        path = run_dir / "stages" / "eval" / "results.json"
        if not path.is_file():
            return None
        value = _lookup(json.loads(path.read_text()), name)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    if (in_loop := schema.task_objective(objective)) is not None:  # the end-of-training value
        _, task, metric = in_loop
        return _final(task_values(run_dir / "stages" / stage / "metrics.jsonl", task, metric))
    return STAGE_OBJECTIVES[name](valid_losses(run_dir / "stages" / stage / "metrics.jsonl"))


def _lookup(data: Any, dotted: str) -> Any:
    """``a.b`` in nested results (a flat key holding dots is tried first)."""
    if isinstance(data, dict) and dotted in data:
        return data[dotted]
    head, _, rest = dotted.partition(".")
    if isinstance(data, dict) and head in data and rest:
        return _lookup(data[head], rest)
    return None


def check_objective(cfg: PipelineConfig) -> None:
    """The objective's and prune stage's stages run in every trial (else nothing would score it)."""
    sc = cfg.search
    stage = sc.objective.partition(".")[0]
    in_loop = schema.task_objective(sc.objective)
    task = in_loop[1] if in_loop else None
    st = cfg.stage(stage) if stage in cfg.run.stages else None
    if task is not None and isinstance(st, TrainStage) and task not in st.eval_tasks:
        raise ConfigError(
            f"search.objective={sc.objective}: {task!r} is not one of {stage}.eval_tasks={list(st.eval_tasks)}; "
            "add it there (in-training tasks score a trial)"
        )
    for key, s in (("objective", stage), ("prune_stage", sc.prune_stage)):
        if s not in cfg.run.stages and not (key == "prune_stage" and sc.pruner == "none"):
            raise ConfigError(
                f"search.{key}={getattr(sc, key)}: stage {s!r} is not in run.stages={cfg.run.stages}; "
                f"add it or choose another (objectives: <stage>.{{{','.join(STAGE_OBJECTIVES)}}}, "
                "<stage>.task.<task>.<metric> or eval.<metric>)"
            )


def _check_names() -> None:
    """The registries hold exactly the schema's names (one list for users, one for code)."""
    for what, names, have in (
        ("SAMPLERS", schema.SAMPLERS, SAMPLERS),
        ("PRUNERS", schema.PRUNERS, PRUNERS),
        ("STAGE_OBJECTIVES", schema.STAGE_OBJECTIVES, STAGE_OBJECTIVES),
    ):
        if set(names) != set(have):
            raise RuntimeError(f"pipeline.schema.search.{what} {sorted(names)} != registry {sorted(have)}")


_check_names()
