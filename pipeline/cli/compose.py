"""The front door shared by ``python -m pipeline`` and its companion commands.

One Hydra compose path (``pipeline.schema.compose.compose``), one error shape for every configuration mistake
whatever catches it (our validation, Hydra's override grammar, OmegaConf's type checks, an unknown key or
group option, a missing value, an input file the pre-flight rejects)::

    config error: <key>=<value>: <what is allowed> (did you mean ...?)

and the exit codes every command uses. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pipeline.schema import hf_model
from pipeline.schema.build import build_traced
from pipeline.schema.compose import CONF_DIR, InFile, compose_traced
from pipeline.schema.config import PipelineConfig
from pipeline.schema.domains import domain_of
from pipeline.schema.errors import ConfigError
from pipeline.schema.origins import YAML_HINTS, Origins, key_lines, leaves, line_key, package_header, shown
from pipeline.submit.interrupt import EXIT_INTERRUPTED
from pipeline.submit.preflight import preflight

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_SUBMIT = 3
EXIT_BUSY = 4
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success (plan: every stage fits; status: nothing failed)",
    EXIT_FAILED: "a stage failed or was cancelled (plan: a stage does not fit in memory; status: a stage "
    "failed, is blocked or cancelled)",
    EXIT_CONFIG: "configuration error: a bad key, value, group option, override or input file; nothing written",
    EXIT_SUBMIT: "submission failed: no sbatch, SLURM controller unreachable, or sbatch rejected the job",
    EXIT_BUSY: "a selected stage runs in another local job (not followed): re-run when it has ended",
    EXIT_INTERRUPTED: "stopped on Ctrl-C, the work kept (a checkpoint at the next step): re-run to continue",
}

COMMANDS: tuple[tuple[str, str], ...] = (
    ("python -m pipeline [key=value ...]", "compose conf/, validate, pre-flight, submit, follow, report"),
    ("python -m pipeline -m key=a,b [...]", "a sweep: every trial validated before the first one runs"),
    (
        "python -m pipeline -m search=optuna key='interval(a,b)'",
        "an Optuna search, controller in the background",
    ),
    ("python -m pipeline.plan [key=value ...]", "layout, memory, FLOPs and step time per training stage"),
    ("python -m pipeline.status <run_dir>", "each stage's state, job ids, requeues, logs and errors"),
    ("python -m pipeline.status|cancel <sweep_dir>", "a search: its trials and best so far | stop it all"),
    ("python -m pipeline.status <run_dir> --watch 5", "a live view redrawn in place, with alarms"),
    ("python -m pipeline.report <run_dir|run.root>", "one self-contained HTML report of a run or a sweep"),
    ("python -m pipeline.cancel <run_dir>", "cancel the run's queued and running jobs"),
    ("python -m pipeline.docs", "regenerate docs/CONFIG.md from the schema"),
)

HIDDEN_OPTIONS = {"schema"}
"""ConfigStore entries that exist for Hydra's type checks, not for users to pick."""

HYDRA_FLAGS = {
    "-c",
    "--cfg",
    "-i",
    "--info",
    "-sc",
    "--shell-completion",
    "--hydra-help",
    "--resolve",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--version",
    "--experimental-rerun",
}
"""Hydra's own flags: those command lines go to Hydra unchanged (tab completion, --info, ...); ``--cfg job`` and
``--config-dir`` are handled by the front door (``pipeline.__main__``)."""


def report(e: ConfigError) -> int:
    """Print the one-line configuration error and return its exit code."""
    print(f"config error: {e}", file=sys.stderr)
    return EXIT_CONFIG


def stopped_on_ctrl_c(command: str, what: str) -> int:
    """A companion command (status --watch, plan --simulate-failures, export) stopped by Ctrl-C
    (``interrupt.CtrlC``): one line saying what it leaves, no traceback, exit 130."""
    print(f"[{command}] stopped on Ctrl-C: {what}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def not_a_run_dir(path: Path) -> int:
    """status/cancel given something that is not a run directory: the one error shape, exit 2."""
    near = [p.name for p in path.parent.iterdir() if (p / "ledger").is_dir()] if path.parent.is_dir() else []
    hint = _hint(path.name, near)
    where = f"; run directories there: {sorted(near)}" if near else ""
    return report(ConfigError(f"run_dir={str(path)!r}: not a run directory (no ledger/ inside){hint}{where}"))


# ---------------------------------------------------------------------------- composing


def load(overrides: list[str], *, inputs: bool = True) -> PipelineConfig:
    """Compose conf/ with ``overrides``, validate, and (``inputs``) pre-flight every input the stages read.

    Every mistake raises ConfigError in the one shape, whatever caught it; a key the command line did not set
    is followed by where its value came from (``pipeline.schema.origins``).
    """
    return load_traced(overrides, inputs=inputs)[0]


def load_traced(overrides: list[str], *, inputs: bool = True) -> tuple[PipelineConfig, Origins]:
    """``load`` that also returns where each value came from."""
    from omegaconf import OmegaConf

    try:
        cfg, origins = compose_traced(overrides)
    except ConfigError:
        raise
    except Exception as e:
        err = normalize(e, overrides)
        if err is None:
            raise
        raise err from None
    try:
        pc, origins = build_traced(cfg, resolve=hf_model.apply, origins=origins)
        if inputs:
            try:
                preflight(pc)
            except ConfigError as e:
                raise ConfigError(origins.annotate(str(e), dict(leaves(pc.to_dict())))) from None
        return pc, origins
    except ConfigError:
        raise
    except Exception as e:  # an interpolation or ??? found while resolving: say which file holds it
        err = normalize(e, overrides)
        if err is None:
            raise
        raw = OmegaConf.to_container(cfg, resolve=False)
        raise ConfigError(
            origins.annotate(str(err), dict(leaves(raw)) if isinstance(raw, dict) else {})
        ) from None


def config_yaml(pc: PipelineConfig, origins: Origins) -> str:
    """The resolved config as YAML, each value that is not the schema default followed by where it came from."""
    import yaml

    lines: list[str] = []

    def emit(d: dict[str, Any], prefix: str, pad: str) -> None:
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and v:
                lines.append(f"{pad}{k}:")
                emit(v, key, pad + "  ")
                continue
            text = yaml.safe_dump(v, default_flow_style=True, width=1 << 30).removesuffix("...\n").strip()
            o = origins.of(key)
            lines.append(f"{pad}{k}: {text}" + (f"  # {o.describe()}" if o is not None else ""))

    emit(pc.to_dict(), "", "")
    return "\n".join(lines) + "\n"


def config_dir_overrides(args: list[str]) -> list[str]:
    """``--config-dir DIR`` / ``-cd DIR`` / ``--config-dir=DIR`` as the override ``hydra.searchpath=[file://DIR]``
    (Hydra adds the directory to its search path either way, after conf/), so that commands with the user's own
    config files go through the front door."""
    out, dirs, i = [], [], 0
    while i < len(args):
        a = args[i]
        flag, eq, val = a.partition("=")
        if flag in ("--config-dir", "-cd"):
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{flag}=?: give the directory of your config files ({flag} DIR)")
                i, val = i + 1, args[i + 1]
            d = Path(val).expanduser().resolve()
            if not d.is_dir():
                raise ConfigError(f"{flag}={val}: no such directory")
            dirs.append(f"'file://{d}'")
        else:
            out.append(a)
        i += 1
    if not dirs:
        return out
    if any(a.split("=", 1)[0] == "hydra.searchpath" for a in out):
        raise ConfigError(
            f"hydra.searchpath: give either it or --config-dir, not both (--config-dir={dirs[0][8:-1]})"
        )
    return [*out, f"hydra.searchpath=[{','.join(dirs)}]"]


def trials(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of every trial (one unless ``multirun``), expanded as Hydra's basic sweeper does."""
    if not multirun:
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        err = normalize(e, overrides)
        if err is None:
            raise
        raise err from None
    return [t for batch in BasicSweeper.split_arguments(parsed, None) for t in batch]


def load_trials(overrides: list[str], multirun: bool) -> list[tuple[list[str], PipelineConfig]]:
    """Every trial composed, validated and pre-flighted; the first bad one raises (naming its trial)."""
    out = []
    all_trials = trials(overrides, multirun)
    for i, t in enumerate(all_trials):
        try:
            out.append((t, load(t)))
        except ConfigError as e:
            if len(all_trials) == 1:
                raise
            raise ConfigError(
                f"{e} [sweep trial {i} of {len(all_trials)}: {' '.join(t)}; nothing ran]"
            ) from None
    return out


# ---------------------------------------------------------------------------- Hydra/OmegaConf errors


def normalize(e: BaseException, overrides: list[str]) -> ConfigError | None:
    """Hydra's or OmegaConf's exception as our ConfigError (None: not a configuration error)."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        InterpolationResolutionError,
        MissingMandatoryValue,
        OmegaConfBaseException,
        ValidationError,
    )
    from yaml import MarkedYAMLError

    if isinstance(e, InFile):
        return _in_file(e)
    if isinstance(e, MarkedYAMLError):
        return _yaml_syntax(e, overrides)
    if not isinstance(e, HydraException | OmegaConfBaseException):
        return None
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    if isinstance(cause, ConfigKeyError | ConfigAttributeError | ValidationError) and "." not in str(
        getattr(cause, "full_key", "") or "."
    ):
        item = _item_key(str(cause.full_key), overrides)  # a key of a list item: OmegaConf names only the key
        if item is not None:
            if isinstance(cause, ValidationError):
                return ConfigError(f"{item[0]}={item[1]}: must be {_kind(item[0])}")
            return _unknown_key(item[0], overrides, value=item[1])
    first = _first_line(str(cause))
    if isinstance(e, OverrideParseException):
        bad = _bad_override(overrides)
        return ConfigError(
            f"{bad}: not a valid override ({first}); write key=value, key=[a,b], +key=value or ~key "
            "(quote values holding , [ ] = or spaces)"
        )
    if isinstance(e, MissingConfigException):
        return _missing_option(e, overrides)
    full_key = str(getattr(cause, "full_key", "") or "")
    if "Ambiguous value for argument" in str(e):
        bad = str(e).split("'")[1] if "'" in str(e) else "?"
        return ConfigError(
            f"{bad}: a comma-separated value is a sweep; add -m (--multirun) to sweep, write [a,b] for a list "
            "or quote it for a string"
        )
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and full_key:
        return _unknown_key(full_key, overrides)
    if "No match in the defaults list" in str(e):
        key = str(e).split("'")[1] if "'" in str(e) else "?"
        return _unknown_key(key, overrides)
    if isinstance(cause, MissingMandatoryValue) and full_key:
        return ConfigError(f"{full_key}=???: missing value; give one ({full_key}=<{_kind(full_key)}>)")
    if isinstance(cause, ValidationError) and full_key:
        value = _override_value(full_key, overrides)
        return ConfigError(f"{full_key}={value}: must be {_kind(full_key)}")
    if isinstance(cause, InterpolationResolutionError) and full_key:
        return ConfigError(f"{full_key}={_override_value(full_key, overrides)}: {first}")
    key = full_key or "<override>"
    return ConfigError(f"{key}={_override_value(key, overrides)}: {first}")


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else text


def _bad_override(overrides: list[str]) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except Exception:
            return o
    return " ".join(overrides)


def _parsed(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return list(OverridesParser.create().parse_overrides(list(overrides)))
    except Exception:
        return []


def _override_value(key: str, overrides: list[str]) -> str:
    return _find_override(key, overrides)[1]


def _find_override(key: str, overrides: list[str]) -> tuple[str, str]:
    """(key, value) of the override that sets ``key`` or a key under it (("key", "?") if none does)."""
    for o in _parsed(overrides):
        k = o.get_key_element().lstrip("+~")
        if o.key_or_group == key or k == key or k.startswith(key + "."):
            return k, (str(o.input_line.split("=", 1)[1]) if "=" in o.input_line else "?")
    return key, "?"


def group_options(group: str) -> list[str]:
    """The options users may pick in a config group (YAML under conf/<group>/)."""
    d = CONF_DIR / group
    return sorted(p.stem for p in d.glob("*.yaml") if p.stem not in HIDDEN_OPTIONS)


def config_groups() -> list[str]:
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def _missing_option(e: Any, overrides: list[str]) -> ConfigError:
    missing = str(getattr(e, "missing_cfg_file", "") or "")
    group, _, option = missing.rpartition("/")
    options = [o for o in (getattr(e, "options", None) or group_options(group)) if o not in HIDDEN_OPTIONS]
    key = group
    for o in _parsed(overrides):
        if o.key_or_group == group and str(o.value()) == option:
            key = o.get_key_element()
            break
    if not group:
        return ConfigError(f"<config>={missing}: {_first_line(str(e))}")
    return ConfigError(
        f"{key}={option}: unknown option of group {group!r}{_hint(option, options)}; options: {options}"
    )


def _hint(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _schema_at(path: list[str]) -> type | None:
    """The dataclass at dotted ``path`` in PipelineConfig (None if the path leaves the schema); ``name[i]`` is an
    item of a list of dataclasses (``data.sources[0]``)."""
    cls: Any = PipelineConfig
    for part in path:
        name, _, index = part.partition("[")
        hints = typing.get_type_hints(cls)
        hint = hints.get(name)
        if index and typing.get_origin(hint) is list:
            hint = typing.get_args(hint)[0]
        if hint is None or not dataclasses.is_dataclass(hint):
            return None
        cls = hint
    return typing.cast(type, cls)


def _item_key(name: str, overrides: list[str]) -> tuple[str, str] | None:
    """(full key, value) of ``name`` inside a list item of an override's value (``data.sources=[{...}]``)."""
    for o in _parsed(overrides):
        try:
            value = o.value()
        except Exception:
            continue
        for k, v in leaves({o.get_key_element().lstrip("+~"): value}):
            if k.endswith("]." + name):
                return k, str(v)
    return None


# ---------------------------------------------------------------------------- mistakes inside YAML files


def _in_file(e: InFile) -> ConfigError:
    """A type error, unknown key or bad value inside a YAML file: the key, the value as written, file and line."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause, origin, package = e.cause, e.origin, e.package
    path = Path(origin.where) if Path(origin.where).is_absolute() else CONF_DIR.parent / origin.where
    lines = key_lines(path.read_text()) if path.is_file() else {}
    rel = str(getattr(cause, "full_key", "") or "")
    if package and rel.startswith(package + "."):
        rel = rel[len(package) + 1 :]
    if rel not in lines:  # a list item's key: OmegaConf names the key only
        rel = next((k for k in lines if k.endswith(("." + rel, "]." + rel))), rel)
    line, written = lines.get(rel, (None, "?"))
    key = f"{package}.{rel}" if package and rel else (rel or package or "<file>")
    where = f"[{key} set at {origin.where}{f':{line}' if line else ''}" + (
        f" ({origin.choice})]" if origin.choice else "]"
    )
    if isinstance(cause, ConfigKeyError | ConfigAttributeError):
        return ConfigError(f"{_unknown_key(key, [], value=written)} {where}")
    if isinstance(cause, ValidationError):
        return ConfigError(f"{key}={written}: must be {_kind(key)} {where}")
    return ConfigError(f"{key}={written}: {_first_line(str(cause))} {where}")


def _yaml_syntax(e: Any, overrides: list[str]) -> ConfigError | None:
    """A YAML file that does not parse (a tab, a bad indent, an open quote): the key on that line, file and line."""
    scanning = e.context_mark is not None and "while scanning a" in str(e.context or "")
    mark = e.context_mark if scanning else (e.problem_mark or e.context_mark)
    path = Path(str(getattr(mark, "name", "")))
    if mark is None or not path.is_file():
        return None
    text = path.read_text()
    line = mark.line + 1
    rel, written = line_key(text, line)
    package = package_header(text)
    if package is None:
        group = path.parent.name
        package = next(
            (
                k.split("@", 1)[1]
                for k, v in _choices(overrides)
                if k.startswith(group + "@") and v == path.stem
            ),
            group,
        )
    key = ".".join(p for p in (package, rel) if p) or path.name
    problem = str(e.problem or e.context or "not valid")
    hint = next(
        (h for k, h in YAML_HINTS if k in f"{problem} {e.context or ''}"),
        "check the indentation and quoting of this line and the one above",
    )
    return ConfigError(
        f"{key}={written}: not valid YAML ({problem}): {hint} [at {shown(path, CONF_DIR)}:{line}:{mark.column + 1}]"
    )


def _choices(overrides: list[str]) -> list[tuple[str, str]]:
    return [(o.key_or_group, str(o.value())) for o in _parsed(overrides) if isinstance(o.value(), str)]


def _unknown_key(full_key: str, overrides: list[str], value: str | None = None) -> ConfigError:
    if value is None:
        okey, value = _find_override(full_key, overrides)
        if okey.startswith(full_key + "."):
            full_key = okey
    parts = full_key.split(".")
    i = 0
    while i < len(parts) - 1 and _schema_at(parts[: i + 1]) is not None:
        i += 1
    parent, name = parts[:i], parts[i]
    cls = _schema_at(parent)
    if cls is None:
        return ConfigError(f"{full_key}={value}: unknown key")
    names = [f.name for f in dataclasses.fields(cls)]
    if name in names:  # a leaf given sub-keys
        return ConfigError(f"{full_key}={value}: {'.'.join(parts[: i + 1])} is not a mapping")
    if not parent:
        names += [g for g in config_groups() if g not in names]
    where = ".".join(parent) or "the top level"
    dotted = [".".join([*parent, n]) for n in names]
    hint = _hint(".".join(parts[: i + 1]), dotted) or _hint(name, names)
    return ConfigError(f"{full_key}={value}: unknown key{hint}; keys of {where}: {sorted(names)}")


def _kind(full_key: str) -> str:
    """What a schema key accepts, in words (for type errors): kind, domain, whether null is allowed."""
    parts = full_key.split(".")
    cls = _schema_at(parts[:-1])
    if cls is None:
        return "a value of the right type"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    f = fields.get(parts[-1])
    if f is None:
        return "a value of the right type"
    hint = typing.get_type_hints(cls)[f.name]
    base, optional = hint, False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next(a for a in args if a is not type(None))
    dom = domain_of(f)
    if dom is not None:
        text = dom.describe()
    elif base is bool:
        text = "true or false"
    elif base is str:
        text = "a string"
    elif typing.get_origin(base) is list:
        text = "a list, e.g. [a,b]"
    elif typing.get_origin(base) is dict:
        text = "a mapping, e.g. {KEY: value}"
    elif dataclasses.is_dataclass(base):
        text = f"a mapping of {getattr(base, '__name__', base)} keys ({', '.join(x.name for x in dataclasses.fields(base))})"
    else:
        text = f"a {getattr(base, '__name__', base)}"
    return text + (" or null" if optional else " (not null)")


# ---------------------------------------------------------------------------- --help


def help_text() -> str:
    lines = ["usage: python -m pipeline [-m] [key=value ...] [group=option ...]", "", "commands:"]
    width = max(len(c) for c, _ in COMMANDS) + 2
    lines += [f"  {c.ljust(width)}{d}" for c, d in COMMANDS]
    lines += ["", "config groups (group=option; parallel is per stage: parallel@pretrain.parallel=dp2):"]
    for g in config_groups():
        lines.append(f"  {g:<12} {', '.join(group_options(g))}")
    lines += [
        "",
        "keys: every key and its domain is in docs/CONFIG.md (e.g. pretrain.lr=3e-4 run.stages=[data_prep,pretrain])",
        "",
        "exit codes:",
    ]
    lines += [f"  {code}  {text}" for code, text in EXIT_CODES.items()]
    lines += [
        "",
        "--cfg job prints the resolved config, each value with where it came from; --config-dir DIR adds your",
        "own YAML files (DIR/experiment/mine.yaml: experiment=mine). Hydra's other flags go to Hydra: --info,",
        "--shell-completion, --hydra-help.",
    ]
    return "\n".join(lines)
