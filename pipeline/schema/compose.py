"""Hydra: the schema in the ConfigStore, ``CONF_DIR`` and ``compose``, the one compose path of every command.

``compose_traced`` also records where each value came from (``pipeline.schema.origins.Origins``): Hydra's
defaults list says which YAML files were merged, in which order and at which package, and which group choices
the command line made; the files' YAML nodes give each key's line; the command-line overrides come last.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.schema.build import build_config
from pipeline.schema.config import PipelineConfig
from pipeline.schema.origins import (
    FILE,
    OVERRIDE,
    Origin,
    Origins,
    Recorder,
    key_lines,
    shown,
)
from pipeline.schema.sections import ClusterConfig, DataConfig, ModelConfig, ParallelConfig


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (conf/config.yaml lists 'pipeline_schema' first)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "pipeline_schema.yaml" in cs.repo:  # once per process: storing the schema costs ~0.4 s each time
        return
    cs.store(name="pipeline_schema", node=PipelineConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="cluster", name="schema", node=ClusterConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="parallel", name="schema", node=ParallelConfig)


def _conf_dir() -> Path:
    """``conf/`` next to the packages in a checkout (or a job's code snapshot); ``pipeline/conf`` in a wheel."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "conf"
    return checkout if (checkout / "config.yaml").is_file() else package / "conf"


CONF_DIR = _conf_dir()


@contextmanager
def _hydra() -> Iterator[None]:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        yield


def compose(
    overrides: list[str] | None = None, config_name: str = "config", return_hydra_config: bool = False
) -> Any:
    """Compose conf/ with Hydra's compose API: the one compose path of every command; returns a DictConfig."""
    from hydra import compose as hydra_compose

    with _hydra():
        return hydra_compose(
            config_name, overrides=list(overrides or []), return_hydra_config=return_hydra_config
        )


def compose_traced(overrides: list[str] | None = None, config_name: str = "config") -> tuple[Any, Origins]:
    """``compose`` plus the origin of every value; a mistake inside a YAML file raises ``InFile`` naming it."""
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    overrides = list(overrides or [])
    with _hydra():
        loader = GlobalHydra.instance().config_loader()
        try:
            cfg = hydra_compose(config_name, overrides=overrides)
        except ConfigCompositionException as e:
            located = in_file(e, loader, config_name, overrides)
            if located is None:
                raise
            raise located from None
        return cfg, trace(loader, config_name, overrides)


def load_config(overrides: list[str] | None = None) -> PipelineConfig:
    """Compose and validate (without the input pre-flight and the error normalization of ``pipeline.cli.compose.load``,
    which the commands use)."""
    cfg, origins = compose_traced(overrides)
    return build_config(cfg, origins=origins)


# ---------------------------------------------------------------------------- origins


class InFile(Exception):
    """A mistake Hydra or OmegaConf found while merging one YAML file: the file (``origin``: where, choice),
    the package it is merged at, and the error raised there (``pipeline.cli`` words it)."""

    def __init__(self, origin: Origin, package: str, cause: BaseException) -> None:
        super().__init__(f"{origin.describe()}: {cause}")
        self.origin = origin
        self.package = package
        self.cause = cause


def _defaults(loader: Any, config_name: str, overrides: list[str]) -> tuple[Any, Any]:
    """Hydra's defaults list for this composition and its config repository (hydra.searchpath applied)."""
    from hydra._internal.defaults_list import create_defaults_list

    # what ConfigLoaderImpl.compute_defaults_list does, keeping its repository (each file is loaded once)
    parsed, repo = loader._parse_overrides_and_create_caching_repo(config_name, overrides)
    dl = create_defaults_list(
        repo=repo, config_name=config_name, overrides_list=parsed, prepend_hydra=True, skip_missing=False
    )
    return dl, repo


def _files(dl: Any, repo: Any) -> list[tuple[Origin, str, Any]]:
    """(file origin, package, ConfigResult) of each YAML file merged, in merge order (Hydra's own configs and
    the schema's structured configs left out)."""
    meta = dl.overrides.override_metadata
    out = []
    for d in dl.defaults:
        path = d.config_path or ""
        if path.startswith("hydra/"):
            continue
        ret = repo.load_config(path)
        if ret is None or ret.is_schema_source or not str(ret.path).startswith("file://"):
            continue
        file = Path(str(ret.path)[len("file://") :]) / f"{path}.yaml"
        group, _, option = path.rpartition("/")
        key = d.override_key or group
        origin = Origin(
            FILE,
            shown(file, CONF_DIR),
            choice=f"{key}={option}" if group and not d.primary else "",
            chosen=bool(key in meta and meta[key].external_override),
            user=not file.resolve().is_relative_to(CONF_DIR.resolve()),
        )
        out.append((origin, d.package or "", ret))
    return out


def trace(loader: Any, config_name: str, overrides: list[str]) -> Origins:
    """The origin of every value the composition of ``config_name`` with ``overrides`` set (Hydra initialised)."""
    from omegaconf import OmegaConf

    dl, repo = _defaults(loader, config_name, overrides)
    rec = Recorder()
    for origin, package, ret in _files(dl, repo):
        data = OmegaConf.to_container(ret.config, resolve=False)
        if not isinstance(data, dict):
            continue
        keys = {str(k): v for k, v in data.items() if k not in ("defaults", "hydra")}
        lines = _lines(origin)
        rec.write(keys, package, lambda rel, o=origin, ln=lines: _at(o, ln.get(rel)))
    for o in dl.config_overrides:
        if o.is_hydra_override() or o.key_or_group.startswith("hydra."):
            continue
        origin = Origin(OVERRIDE, o.input_line or o.key_or_group, user=True)
        value = None if o.is_delete() else o.value()
        rec.write({o.key_or_group: value}, "", lambda _rel, org=origin: org)
    return rec.origins()


def _lines(origin: Origin) -> dict[str, int]:
    """Line of each key of a file, keyed by its path in the file (= relative to the package it is merged at)."""
    path = Path(origin.where) if Path(origin.where).is_absolute() else CONF_DIR.parent / origin.where
    try:
        text = path.read_text()
    except OSError:
        return {}
    return {k: line for k, (line, _) in key_lines(text).items()}


def _at(origin: Origin, line: int | None) -> Origin:
    return Origin(origin.kind, origin.where, line, origin.choice, origin.chosen, origin.user)


def in_file(e: BaseException, loader: Any, config_name: str, overrides: list[str]) -> InFile | None:
    """Hydra's ``In '<config path>': <error> raised while composing config`` as ``InFile`` (None: not that)."""
    import re

    m = re.match(r"In '([^']+)':", str(e))
    cause = e.__cause__ or e.__context__
    if m is None or cause is None:
        return None
    full_key = str(getattr(cause, "full_key", "") or "")
    try:
        files = _files(*_defaults(loader, config_name, overrides))
    except Exception:  # the defaults list itself fails: no file to name
        return None
    name = f"{m.group(1)}.yaml"
    found = [(o, pkg) for o, pkg, _ in files if o.where == name or o.where.endswith("/" + name)]
    for origin, package in found:  # a file merged at several packages: the one holding the key
        if not package or full_key == package or full_key.startswith(package + "."):
            return InFile(origin, package, cause)
    return InFile(*found[0], cause) if found else None
