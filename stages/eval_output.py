"""The eval stage's output: ``results.json``, its metrics lines and the comparison table it prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.context import MetricsWriter, StageContext
from pipeline.records.files import atomic_write_text

RESULTS = "results.json"


def write_results(ctx: StageContext, out: dict[str, Any]) -> None:
    from engine.evaluation.tasks import metric_fields

    atomic_write_text(Path(ctx.out_dir) / RESULTS, json.dumps(out, indent=2) + "\n")
    metrics = MetricsWriter(ctx.metrics_path)
    if "reward_model" in out:
        metrics.write(
            {"kind": "eval", "model": "reward_model", "pref_accuracy": out["reward_model"]["pref_accuracy"]}
        )
    for stage, r in out["models"].items():
        metrics.write(
            {
                "kind": "eval",
                "model": stage,
                "perplexity": r["perplexity"],
                "task_accuracy": r["task_accuracy"],
                "pref_accuracy": r["pref_accuracy"],
            }
        )
        for task, sec in r.get("lm_eval", {}).items():
            metrics.write({"kind": "eval_task", "model": stage, "task": task, **metric_fields(sec)})


def format_table(out: dict[str, Any]) -> str:
    """The models side by side: perplexity, task accuracy, preference accuracy."""

    d = out["data"]
    lines = [
        f"eval on {d['valid_tokens']} valid tokens, {d['task_examples']} task prompts, {d['pref_pairs']} preference pairs",
        f"{'model':<10} {'iter':>6} {'ppl':>9} {'task acc':>9} {'pref acc':>9}",
    ]

    def cell(value: float | None, fmt: str) -> str:
        return f"{'-' if value is None else format(value, fmt):>9}"

    for stage, r in out["models"].items():
        lines.append(
            f"{stage:<10} {r['iteration'] or 0:>6} {cell(r['perplexity'], '.2f')} "
            f"{cell(r['task_accuracy'], '.1%')} {cell(r['pref_accuracy'], '.1%')}"
        )
    if "reward_model" in out:
        r = out["reward_model"]
        lines.append(
            f"{'reward_model':<12} {r['iteration'] or 0:>4} {'':>9} {'':>9} {cell(r['pref_accuracy'], '.1%')}"
        )
    for stage, why in out["skipped"].items():
        lines.append(f"{stage:<10} skipped: {why}")
    return "\n".join(lines + _task_lines(out))


def _task_lines(out: dict[str, Any]) -> list[str]:
    """lm-eval's task metrics of every model, value +- standard error (none when no task was run)."""
    rows = [
        (stage, task, name, m)
        for stage, r in out["models"].items()
        for task, sec in r.get("lm_eval", {}).items()
        for name, m in sec["metrics"].items()
    ]
    if not rows:
        return []
    lines = [f"{'model':<10} {'task':<20} {'metric':<24} {'value':>9} {'stderr':>9}"]
    for stage, task, name, m in rows:
        value = "-" if m["value"] is None else f"{m['value']:.4f}"
        err = "" if m["stderr"] is None else f"± {m['stderr']:.4f}"
        lines.append(f"{stage:<10} {task:<20} {name:<24} {value:>9} {err:>9}")
    return lines
