"""``python -m pipeline [-m] [overrides]``: compose, validate, pre-flight, plan, submit, report.

Every trial of a sweep (``-m``) is composed, validated and pre-flighted before the first one runs; each runs
in its own deterministic run directory. Exit codes (``--help``, README): 0 ok, 1 a stage failed,
2 configuration error (nothing written), 3 submission failed, 4 a selected stage
runs in another local job (not followed: re-run when it has ended), 130 stopped on Ctrl-C (the work kept).
"""

from __future__ import annotations

import sys

from pipeline.cli.compose import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_SUBMIT,
    HYDRA_FLAGS,
    config_dir_overrides,
    config_yaml,
    help_text,
    load_traced,
    load_trials,
    report,
)
from pipeline.schema.errors import ConfigError
from pipeline.submit.interrupt import CtrlC, ctrl_c_raises


def main(argv: list[str] | None = None) -> int:
    try:
        with ctrl_c_raises():
            return _main(argv)
    except CtrlC:  # Ctrl-C outside the local executor's loop (which keeps the work itself)
        print("stopped on Ctrl-C; run the same command again to continue", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(help_text())
        return 0
    try:
        args = config_dir_overrides(args)
    except ConfigError as e:
        return report(e)
    shown = _cfg_job(args)
    if shown is not None:
        return _show_config(shown)
    if any(a.split("=", 1)[0] in HYDRA_FLAGS for a in args):
        return _hydra_main(args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        return report(ConfigError(f"{flags[0]}: unknown flag; see python -m pipeline --help"))
    if multirun:
        from pipeline.search.launch import selected, start

        try:
            if selected(overrides):
                return start(overrides, sys.stdout)
        except ConfigError as e:
            return report(e)
    try:
        runs = load_trials(overrides, multirun)
    except ConfigError as e:
        return report(e)
    _configure_logging(runs[0][0])
    codes = []
    for i, (trial, cfg) in enumerate(runs):
        if multirun:
            print(f"[sweep] trial {i} of {len(runs)}: {' '.join(trial)}", flush=True)
        codes.append(_execute(cfg))
        if codes[-1] == EXIT_INTERRUPTED:  # Ctrl-C stops the sweep too
            break
    roots = {cfg.run.root for _, cfg in runs}
    if multirun and len(runs) > 1 and len(roots) == 1:  # one report across the sweep's run directories
        from pipeline.submit.orchestrate import write_sweep_report

        write_sweep_report(roots.pop())
    return max(codes, default=0)


def _execute(cfg: object) -> int:
    from pipeline.submit.interrupt import Stopped
    from pipeline.submit.orchestrate import RunError, SubmitError, execute

    try:
        return execute(cfg)  # type: ignore[arg-type]
    except Stopped as e:  # Ctrl-C: the one line (what stopped, what was kept, how to go on)
        print(e, file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as e:
        return report(e)
    except SubmitError as e:
        print(f"submission failed: {e}", file=sys.stderr)
        return EXIT_SUBMIT
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


def _cfg_job(args: list[str]) -> list[str] | None:
    """The overrides of ``--cfg job`` / ``-c job`` (with or without ``--resolve``) and no other Hydra flag
    (None: not that command line)."""
    rest, seen, i = [], False, 0
    while i < len(args):
        a = args[i]
        if a in ("--cfg", "-c") and i + 1 < len(args) and args[i + 1] == "job":
            seen, i = True, i + 2
            continue
        if a in ("--cfg=job", "-c=job"):
            seen = True
        elif a != "--resolve":
            rest.append(a)
        i += 1
    if not seen or any(a.split("=", 1)[0] in HYDRA_FLAGS for a in rest):
        return None
    return rest


def _show_config(overrides: list[str]) -> int:
    """``--cfg job``: the config as the run will use it (``hf:`` models resolved, every check passed, inputs not
    read), each value not at its schema default followed by where it came from."""
    try:
        pc, origins = load_traced(overrides, inputs=False)
    except ConfigError as e:
        return report(e)
    print(config_yaml(pc, origins), end="")
    return 0


def _configure_logging(overrides: list[str]) -> None:
    """Python logging as Hydra's job_logging config says (conf/config.yaml: stdout)."""
    from hydra.core.utils import configure_log

    from pipeline.schema.compose import compose

    cfg = compose(overrides, return_hydra_config=True)
    configure_log(cfg.hydra.job_logging, cfg.hydra.verbose)


def _hydra_main(args: list[str]) -> int:
    """Hydra's own flags (--info, --shell-completion, --config-name, ...): Hydra's entry point, unchanged."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from pipeline.schema import hf_model
    from pipeline.schema.build import build_traced
    from pipeline.schema.compose import CONF_DIR, register_configs, trace
    from pipeline.submit.preflight import preflight

    codes: list[int] = []

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def run(cfg: DictConfig) -> None:
        hc = HydraConfig.get()
        overrides = [*hc.overrides.hydra, *hc.overrides.task]
        origins = trace(GlobalHydra.instance().config_loader(), str(hc.job.config_name), overrides)
        try:
            pc, _ = build_traced(cfg, resolve=hf_model.apply, origins=origins)
            preflight(pc)
            codes.append(_execute(pc))
        except ConfigError as e:
            codes.append(report(e))

    register_configs()
    sys.argv = [sys.argv[0], *args]
    run()
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
