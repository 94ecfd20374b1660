"""The ``search`` section: hyperparameter search with Optuna over a ``-m`` sweep (pipeline.search runs it).

Off by default: a ``-m`` sweep of comma lists is then a grid, as Hydra's basic sweeper expands it. With
``search=optuna`` (conf/search/optuna.yaml) the sweep's searched keys (``choice``, ``range``, ``interval``,
``tag(log, interval(...))``) are a search space and a controller asks Optuna for ``n_trials`` points.
The names below are the registries' keys (pipeline.search.registry checks that they match).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.schema.domains import check_domains, choice, fail, num
from pipeline.schema.graph import TRAIN_STAGES

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("none", "median", "asha", "successive_halving", "hyperband")
STAGE_OBJECTIVES = ("final_valid_loss", "best_valid_loss")
"""Objectives read from a training stage's metrics.jsonl: ``<stage>.<name>``; ``eval.<metric>`` reads eval's results."""
DIRECTIONS = ("minimize", "maximize")
POLL_FLOOR_S = 0.5
"""The shortest poll interval: one scheduler query per poll for all trials, never more often than this."""


def task_objective(objective: str) -> tuple[str, str, str] | None:
    """(stage, task, metric) of an objective ``<stage>.task.<task>.<metric>``; None for any other form."""
    stage, _, name = objective.partition(".")
    task, _, metric = name.removeprefix("task.").partition(".")
    return (stage, task, metric) if name.startswith("task.") and task and metric else None


@dataclass
class SearchConfig:
    """Hyperparameter search: Optuna samplers and pruners over the searched keys of a ``-m`` sweep."""

    enabled: bool = False
    """Run ``-m`` as an Optuna search (search=optuna sets it); false: a ``-m`` sweep is a grid of every combination."""
    n_trials: int = num(16, ge=1)
    """Trials the study runs in all (completed, pruned and failed ones count; a resumed study counts those it has)."""
    max_concurrent: int = num(2, ge=1)
    """Trials in flight at once: a slot is refilled as soon as any trial ends or is pruned."""
    sampler: str = "tpe"
    """Optuna sampler: tpe, random, grid (choice/range keys only: every point once), cmaes."""
    pruner: str = "none"
    """Optuna pruner over the trials' intermediate values (see prune_stage): none, median, asha (= successive_halving), hyperband."""
    objective: str = "pretrain.final_valid_loss"
    """What a trial scores: <stage>.final_valid_loss or <stage>.best_valid_loss of a training stage, <stage>.task.<task>.<metric> (the last value of one of the stage's in-training lm-eval tasks, <stage>.eval_tasks), or eval.<metric> (a number in eval's results.json)."""
    direction: str = "minimize"
    """minimize or maximize the objective."""
    prune_stage: str = "pretrain"
    """The training stage whose values at each validation (metrics.jsonl, every eval_interval steps) are the pruner's intermediate values: the objective's own in-training task values when it is <prune_stage>.task.<task>.<metric>, else the valid losses (negated under direction=maximize)."""
    min_resource: int | None = num(None, integer=True, ge=1)
    """asha/hyperband: the steps of the first rung (None: Optuna's auto)."""
    reduction_factor: int = num(3, ge=2)
    """asha/hyperband: the share of trials kept at each rung is 1/reduction_factor."""
    warmup_steps: int = num(0, ge=0)
    """median: steps before a trial can be pruned."""
    seed: int = num(0, ge=0, le=2**31 - 1)
    """Sampler seed."""
    poll_s: float = num(5.0, ge=POLL_FLOOR_S)
    """Seconds between the controller's polls (one scheduler query and one metrics read per trial each)."""

    def __post_init__(self) -> None:
        check_domains(self)
        choice("sampler", self.sampler, SAMPLERS)
        choice("pruner", self.pruner, PRUNERS)
        choice("direction", self.direction, DIRECTIONS)
        choice("prune_stage", self.prune_stage, TRAIN_STAGES)
        stage, _, name = self.objective.partition(".")
        if stage == "eval":
            if not name:
                fail("objective", self.objective, "eval.<metric>: name a metric of eval's results.json")
            return
        if stage in TRAIN_STAGES and task_objective(self.objective):
            return
        if stage not in TRAIN_STAGES or name not in STAGE_OBJECTIVES:
            fail(
                "objective",
                self.objective,
                f"must be <stage>.<name> with stage one of {list(TRAIN_STAGES)} and name one of "
                f"{list(STAGE_OBJECTIVES)}, <stage>.task.<task>.<metric>, or eval.<metric>",
            )
