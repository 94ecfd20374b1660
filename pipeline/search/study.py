"""A search's files under its sweep directory (``run.root``) and its Optuna study in journal storage.

``<sweep>/.search/``: ``spec.json`` (the command line that defines the search), ``journal.log`` (Optuna's
JournalFileBackend, with its open-lock: a lock file created with O_EXCL, which works on NFS and the other
shared filesystems clusters use), ``controller.json`` (the controller's process), ``trials/`` (one file per
trial: pipeline.search.trials), ``logs/``; ``<sweep>/best.yaml`` once a trial completed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.records.files import atomic_write_text
from pipeline.schema.config import PipelineConfig
from pipeline.schema.errors import ConfigError
from pipeline.search import registry
from pipeline.search.space import Space, parse

STUDY = "search"


def search_dir(sweep: Path) -> Path:
    return sweep / ".search"


def is_sweep(path: Path) -> bool:
    return (search_dir(path) / "spec.json").is_file()


def write_spec(sweep: Path, overrides: list[str]) -> None:
    """Record the search's command line; the same command again resumes, another one is refused."""
    path = search_dir(sweep) / "spec.json"
    if path.is_file():
        had = json.loads(path.read_text())["overrides"]
        if had != overrides:
            raise ConfigError(
                f"run.root={sweep}: holds another search ({' '.join(had)}); re-run that command to resume it "
                "or choose another run.root"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"overrides": overrides}, indent=1))


def read_spec(sweep: Path) -> list[str]:
    return list(json.loads((search_dir(sweep) / "spec.json").read_text())["overrides"])


def space_of(sweep: Path) -> Space:
    return parse(read_spec(sweep))


def storage(sweep: Path) -> Any:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    path = str(search_dir(sweep) / "journal.log")
    return JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))


def open_study(sweep: Path, cfg: PipelineConfig, space: Space) -> Any:
    """The sweep's study, created on the first call and loaded (samplers' state included) afterwards."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sc = cfg.search
    iters = cfg.stage(sc.prune_stage).iters  # type: ignore[union-attr]
    return optuna.create_study(
        storage=storage(sweep),
        study_name=STUDY,
        direction="maximize" if sc.direction == "maximize" else "minimize",
        sampler=registry.SAMPLERS[sc.sampler](sc, space),
        pruner=registry.PRUNERS[sc.pruner](sc, iters),
        load_if_exists=True,
    )


def load_study(sweep: Path) -> Any:
    """The study as it stands, for status and reports (no sampler needed)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=STUDY, storage=storage(sweep))


def write_best(sweep: Path, study: Any, space: Space) -> Path | None:
    """``<sweep>/best.yaml``: the overrides that reproduce the best completed trial (None: none completed)."""
    import yaml
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not done:
        return None
    best = study.best_trial
    data = {
        "trial": best.number,
        "value": best.value,
        "direction": study.direction.name.lower(),
        "run_dir": best.user_attrs.get("run_dir"),
        "params": dict(best.params),
        "overrides": space.trial_overrides(best.params),
        "command": "python -m pipeline " + " ".join(space.trial_overrides(best.params)),
    }
    path = sweep / "best.yaml"
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))
    return path


def write_summary(sweep: Path, study: Any, cfg: PipelineConfig, space: Space) -> None:
    """``.search/study.json``: every trial's state, value, best so far, pruning step and slot time, for the
    sweep's report (pipeline.reporting.search), which reads no Optuna storage."""
    sign = -1.0 if cfg.search.direction == "maximize" else 1.0
    rows, best, best_row = [], None, None
    for t in study.get_trials(deepcopy=False):
        state = t.state.name.lower()
        value = t.value if state == "complete" else None
        if value is not None and (best is None or sign * value < sign * best):
            best, best_row = value, {"number": t.number, "value": value}
        rows.append(
            {
                "number": t.number,
                "state": state,
                "value": value,
                "best": best if value is not None else None,
                "pruned_step": (t.user_attrs.get("pruned") or {}).get("step"),
                "wall_s": t.user_attrs.get("wall_s"),
                "params": dict(t.params),
            }
        )
    data = {
        "objective": cfg.search.objective,
        "direction": cfg.search.direction,
        "n_trials": cfg.search.n_trials,
        "keys": list(space.dims),
        "best": best_row,
        "importances": importances(study, cfg.search.seed),
        "trials": rows,
    }
    atomic_write_text(search_dir(sweep) / "study.json", json.dumps(data, indent=1))


def importances(study: Any, seed: int) -> dict[str, float] | None:
    """Each searched key's share of the objective's variance over the completed trials (Optuna's fANOVA,
    seeded); None with fewer than two completed trials or nothing to tell apart."""
    import optuna
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if len(done) < 2:
        return None
    try:
        got = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=seed)
        )
    except (RuntimeError, ValueError):  # e.g. every completed trial at the same point
        return None
    return {k: float(v) for k, v in got.items()}
