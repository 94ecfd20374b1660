"""``python -m pipeline -m search=optuna ...``: validate the search, probe its box, start the controller detached.

Before anything is submitted: the base config and the search section are validated, the sampler is built
(grid needs choice/range keys), and every corner of the box (pipeline.search.space.Space.corners) is composed,
validated and pre-flighted as a trial would be, so a space that can produce an invalid trial, or names a key
that does not exist, is a config error naming the key and the corner. The command then returns with the sweep
directory; the controller runs on in the background (its log: ``<sweep>/.search/controller.log``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from pipeline.cli.compose import load
from pipeline.schema.errors import ConfigError
from pipeline.search import registry, trials
from pipeline.search import study as studies
from pipeline.search.space import Space, parse


def selected(overrides: list[str]) -> bool:
    """Whether a ``-m`` command line is a search (search=optuna or search.enabled=true, here or in a preset)."""
    try:
        space = parse(overrides)
    except ConfigError:  # no searched key: a search of nothing is refused by start()
        base = [o for o in overrides if "," not in o and "(" not in o]
        return bool(load(base, inputs=False).search.enabled) if base else False
    except Exception:  # not Hydra's grammar: the grid's path reports it in the usual shape
        return False
    return bool(load([*space.base, *space.search], inputs=False).search.enabled)


def probe(space: Space) -> int:
    """Validate every corner of the box as a trial; returns how many were checked."""
    corners = space.corners()
    for i, point in enumerate(corners):
        try:
            load(space.trial_overrides(point))
        except ConfigError as e:
            shown = " ".join(f"{k}={v}" for k, v in point.items())
            raise ConfigError(
                f"{e} [search space corner {i + 1} of {len(corners)}: {shown}; the box can give invalid "
                "trials: narrow it; nothing submitted]"
            ) from None
    return len(corners)


def start(overrides: list[str], out: TextIO) -> int:
    """Check the search, record it under run.root and start (or find running) its controller."""
    space = parse(overrides)
    cfg = load([*space.base, *space.search])
    registry.check_objective(cfg)
    registry.SAMPLERS[cfg.search.sampler](cfg.search, space)  # a grid over an interval: config error now
    checked = probe(space)
    sweep = Path(cfg.run.root).resolve()
    spec = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "run.root"] + [f"run.root={sweep}"]
    studies.write_spec(sweep, spec)
    print(f"search: {len(space.dims)} keys, {checked} corners of the box valid", file=out)
    if controller_alive(sweep):
        print(f"search: its controller already runs; sweep directory: {sweep}", file=out)
        return 0
    spawn(sweep)
    print(f"sweep directory: {sweep}", file=out)
    print(f"  python -m pipeline.status {sweep}    python -m pipeline.cancel {sweep}", file=out)
    return 0


def controller_alive(sweep: Path) -> bool:
    p = studies.search_dir(sweep) / "controller.json"
    if not p.is_file():
        return False
    c = json.loads(p.read_text())
    return trials.alive(c.get("pid"), c.get("start"))


def spawn(sweep: Path) -> None:
    """The controller as a background process in its own session (it outlives this command)."""
    log = studies.search_dir(sweep) / "controller.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(trials.PROJECT), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "ab") as f:
        subprocess.Popen(
            [sys.executable, "-m", "pipeline.search", str(sweep)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
