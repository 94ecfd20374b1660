"""Pre-flight of ``eval.tasks``: every name known to lm-eval (its bundled tasks and those under ``task_paths``),
with did-you-mean from lm-eval's registry, and every task's data there without network: local data files that
exist, or a Hugging Face dataset already in the datasets cache. Problems come back as
``(key, value, why)``; the caller raises them (pipeline.submit.preflight.tasks)."""

from __future__ import annotations

import difflib
import fnmatch
import glob
from pathlib import Path
from typing import Any

from engine.evaluation.tasks import task_manager

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""``dataset_path`` values that read ``dataset_kwargs.data_files`` (Hugging Face datasets' packaged builders)."""

Problem = tuple[str, str, str]


def task_problems(
    tasks: list[str], task_paths: list[str], key: str = "eval.tasks", own: tuple[str, ...] = ()
) -> list[Problem]:
    """Unknown names (with the closest known ones), then tasks whose data is not available offline; each
    problem names ``<key>[i]``. Names in ``own`` (tasks the caller defines itself) are not looked up."""
    manager = task_manager(task_paths, [t for t in tasks if t not in own])
    known = list(manager.all_tasks)
    problems: list[Problem] = []
    for i, name in enumerate(tasks):
        if name in own:
            continue
        if any(c in name for c in "*?[") and fnmatch.filter(known, name):
            continue  # a pattern, as lm-eval's own command line takes them
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            where = f" (bundled, or under eval.task_paths={list(task_paths)})"
            problems.append((f"{key}[{i}]", name, f"unknown lm-eval task{where}{hint}"))
            continue
        entry = manager.task_index[name]
        if (
            entry.cfg is not None and "dataset_path" in entry.cfg
        ):  # plain tasks (a group's members: at run time)
            why = data_problem(entry.cfg, entry.yaml_path)
            if why:
                problems.append((f"{key}[{i}]", name, why))
    return problems


def data_problem(cfg: dict[str, Any], yaml_path: Path | None) -> str | None:
    """Why a task's data cannot be read offline (None: it can)."""
    path = str(cfg["dataset_path"])
    if path in LOCAL_BUILDERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        for f in _files(files):
            if not glob.glob(str(Path(f).expanduser())):
                return f"its data file {f} does not exist (dataset_kwargs.data_files in {yaml_path})"
        return None if files else f"dataset_path: {path} without dataset_kwargs.data_files ({yaml_path})"
    if Path(path).expanduser().exists():
        return None  # a local dataset folder
    if _in_hf_cache(path):
        return None
    name = cfg.get("dataset_name")
    return (
        f"its data, the Hugging Face dataset {path}" + (f" ({name})" if name else "") + ", is not in the "
        "datasets cache; without network provide it by running "
        f"datasets.load_dataset({path!r}{f', {name!r}' if name else ''}) where there is network and copying "
        "the cache (HF_DATASETS_CACHE / HF_HOME) to the cluster, with HF_DATASETS_OFFLINE=1 set for the jobs, "
        "or by a task YAML under eval.task_paths whose dataset_path: json and dataset_kwargs.data_files point at "
        "local files (docs/evaluation.md)"
    )


def _files(files: Any) -> list[str]:
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for v in files.values() for f in _files(v)]
    return [str(f) for f in files]


def _in_hf_cache(dataset: str) -> bool:
    """The dataset's folder in the datasets cache (prepared) or the hub cache (downloaded files)."""
    from datasets import config
    from huggingface_hub import constants

    prepared = Path(config.HF_DATASETS_CACHE) / dataset.replace("/", "___")
    hub = Path(constants.HF_HUB_CACHE) / ("datasets--" + dataset.replace("/", "--"))
    return prepared.is_dir() or hub.is_dir()
