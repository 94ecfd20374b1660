"""Status and cancel of a search's sweep directory (``python -m pipeline.status|cancel <sweep_dir>``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from pipeline.search import study as studies
from pipeline.search import trials
from pipeline.search.launch import controller_alive, controller_job


def study_lines(sweep: Path) -> list[str]:
    """The study: the controller, trials by state, each trial's value or why it ended, the best so far."""
    from optuna.trial import TrialState

    job = controller_job(sweep)
    where = f" (SLURM job {job})" if job else ""
    lines = [
        f"search {sweep}",
        f"  controller: {'running' if controller_alive(sweep) else 'not running'}{where}",
    ]
    if not (studies.search_dir(sweep) / "journal.log").is_file():
        return [*lines, "  no trial asked yet"]
    study = studies.load_study(sweep)
    all_trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in all_trials:
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    wall = sum(float(t.user_attrs.get("wall_s", 0.0)) for t in all_trials)
    lines.append(f"  trials: {len(all_trials)} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
    lines.append(f"  slot time used: {wall:.0f} s (finished trials, submission to end)")
    for t in all_trials:
        lines.append(f"  #{t.number:<3} {t.state.name.lower():<9} {_detail(t)}")
    done = [t for t in all_trials if t.state == TrialState.COMPLETE]
    if done:
        b = study.best_trial
        lines.append(
            f"  best: #{b.number} value {b.value:.6g} {json.dumps(b.params)} ({sweep / 'best.yaml'})"
        )
    return lines


def _detail(t: Any) -> str:
    params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())
    if "pruned" in t.user_attrs:
        p = t.user_attrs["pruned"]
        return f"at step {p.get('step')} ({p.get('value', 0):.4g})  {params}"
    if t.value is not None:
        return f"{t.value:.6g}  {params}"
    if "error" in t.user_attrs:
        return f"{params}  {str(t.user_attrs['error'])[:120]}"
    return f"{params}  {t.user_attrs.get('run_dir', '')}"


def status(sweep: Path) -> int:
    print("\n".join(study_lines(sweep)))
    return 0


def cancel(sweep: Path) -> list[int]:
    """Stop the controller (first: it submits nothing more), then every trial in flight; returns their numbers."""
    import optuna
    from optuna.trial import TrialState

    _stop_controller(sweep)
    done = []
    for tf in trials.load_all(sweep):
        if tf.ended is not None:
            continue
        trials.stop(tf, "cancelled", by="pipeline.cancel")
        tf.ended = "cancelled"
        trials.save(sweep, tf)
        done.append(tf.number)
    if (studies.search_dir(sweep) / "journal.log").is_file():
        study = studies.load_study(sweep)
        for ft in study.get_trials(deepcopy=False):
            if ft.state == TrialState.RUNNING:
                optuna.trial.Trial(study, ft._trial_id).set_user_attr("error", "cancelled by pipeline.cancel")
                study.tell(ft.number, state=TrialState.FAIL)
    return done


def _stop_controller(sweep: Path, wait_s: float = 30.0) -> None:
    if not controller_alive(sweep):
        return
    job = controller_job(sweep)
    if job is not None:  # scancel: SLURM does not requeue a cancelled job
        from pipeline.slurm.queries import cancel_jobs

        cancel_jobs([job])
        _wait_gone(sweep, wait_s)
        return
    pid = int(json.loads((studies.search_dir(sweep) / "controller.json").read_text())["pid"])
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not _wait_gone(sweep, wait_s):
        os.killpg(pid, signal.SIGKILL)


def _wait_gone(sweep: Path, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while controller_alive(sweep):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
