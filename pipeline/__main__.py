"""``python -m pipeline [overrides]``: compose, validate, plan, submit, report. Always exits with a code.

Hydra composes conf/ (schema in pipeline/config.py); ``-m`` sweeps run one pipeline per trial, each with
its own deterministic run directory. Exit codes: 0 ok, 1 a stage failed, 2 configuration error.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeline.config import ConfigError, build_config, register_configs
from pipeline.orchestrate import RunError, execute

_exit_codes: list[int] = []  # one per trial: Hydra's decorator swallows return values
_roots: list[str] = []  # run.root of each trial: a sweep's report is written across its run directories


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        pc = build_config(cfg)
        _roots.append(pc.run.root)
        code = execute(pc)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        code = 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    _exit_codes.append(code)


if __name__ == "__main__":
    register_configs()
    main()
    if len(_exit_codes) > 1 and len(set(_roots)) == 1:
        from pipeline.orchestrate import write_sweep_report

        write_sweep_report(_roots[0])
    sys.exit(max(_exit_codes, default=0))
