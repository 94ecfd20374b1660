"""One self-contained HTML page per run (or per sweep folder): curves, eval table, timeline, alarms, config.

Built from the run directory only (ledger, events.jsonl, each stage's metrics.jsonl, eval's results.json,
provenance/); inline SVG and CSS, a few lines of inline JavaScript that write any page error into the
DOM (``<body data-errors>``); nothing is fetched from the network. ``python -m pipeline.report`` is the CLI.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.records.alarm_log import read_alarms
from pipeline.records.ledger import Ledger, read_metrics
from pipeline.reporting.moe import moe_charts
from pipeline.reporting.results import task_grid
from pipeline.reporting.search import search_section
from pipeline.reporting.svg import PALETTE, Series, line_chart
from pipeline.schema.graph import STAGES, TRAIN_STAGES

CURVES = (
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s"),
    ("mfu", "MFU"),
)
EVAL_COLUMNS = ("iteration", "valid_loss", "perplexity", "task_accuracy", "pref_accuracy", "pref_margin")

CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:flex;flex-wrap:wrap;gap:6px}figure.plot{margin:0;border:1px solid #e3e3e3}
svg text{font-size:10px;fill:#333}svg text.title{font-size:12px;font-weight:600}
svg .frame{fill:#fcfcfc;stroke:#bbb}svg .grid{stroke:#eee}
pre{background:#f6f6f6;padding:8px;font-size:12px;max-height:420px;overflow:auto}
.alarm{color:#b00}.muted{color:#777}
"""

ERROR_JS = """
window.__errors=[];
window.addEventListener('error',function(e){window.__errors.push(String(e.message));
document.body.setAttribute('data-errors',window.__errors.join(' | '));});
document.addEventListener('DOMContentLoaded',function(){
var figs=document.querySelectorAll('figure.plot');var drawn=0;
for(var i=0;i<figs.length;i++){if(figs[i].querySelector('polyline')){drawn++;}}
document.body.setAttribute('data-plots',figs.length);document.body.setAttribute('data-plots-drawn',drawn);});
"""


def _esc(v: Any) -> str:
    return html.escape(str(v))


def _num(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _esc("-" if v is None else v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "", raw: bool = False) -> str:
    """A table; numbers right-aligned with their exact value in ``data-value``."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for v in row:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                cells.append(f'<td class="num" data-value="{json.dumps(v)}">{_num(v)}</td>')
            else:
                cells.append(f"<td>{v if raw else _esc('-' if v is None else v)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _series(recs: list[dict[str, Any]], kind: str, key: str) -> tuple[list[float], list[float]]:
    sel = [r for r in recs if r.get("kind") == kind and isinstance(r.get(key), (int, float))]
    return [float(r["step"]) for r in sel], [float(r[key]) for r in sel]


def stage_curves(stage: str, recs: list[dict[str, Any]]) -> str:
    charts = []
    for key, title in CURVES:
        series: list[Series] = [("train", *_series(recs, "train", key))]
        if key == "loss":
            series.append(("valid", *_series(recs, "valid", "loss")))
        charts.append(line_chart(f"{stage}: {title}", series))
    charts += moe_charts(stage, recs)  # a MoE model's routing (pipeline/reporting/moe.py)
    charts += task_charts(stage, recs)
    return f'<div class="plots" id="curves-{stage}">{"".join(charts)}</div>'


def task_charts(stage: str, recs: list[dict[str, Any]]) -> list[str]:
    """One chart per in-training lm-eval task (``eval_task`` lines): each metric against the step."""
    lines = [r for r in recs if r.get("kind") == "eval_task" and isinstance(r.get("step"), (int, float))]
    charts = []
    for task in dict.fromkeys(str(r.get("task")) for r in lines):
        own = [r for r in lines if str(r.get("task")) == task]
        names = [
            k
            for k in dict.fromkeys(k for r in own for k in r)
            if k not in ("kind", "step", "task", "model", "eval_task_s") and not k.endswith("_stderr")
        ]
        series: list[Series] = [
            (name, *_series(own, "eval_task", name)) for name in names if _series(own, "eval_task", name)[0]
        ]
        if series:
            charts.append(line_chart(f"{stage}: {task}", series))
    return charts


def _last(recs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next((r for r in reversed(recs) if r.get("kind") == kind), {})


def left_out(outputs: dict[str, Any]) -> str:
    """A completed training stage's examples lost to truncation (engine.data.truncation), e.g. ``2 of 16
    preference pairs``; empty when nothing is cut (pretrain) or the stage did not complete."""
    t = outputs.get("truncation")
    if not isinstance(t, dict):
        return ""
    return f"{t.get('emptied', 0)} of {t.get('examples', 0)} {t.get('what', 'examples')} (seq_length {t.get('seq_length')})"


def stage_summary(stage: str, recs: list[dict[str, Any]], outputs: dict[str, Any] | None = None) -> list[Any]:
    t, v = _last(recs, "train"), _last(recs, "valid")
    mem = t.get("mem_alloc_gb", t.get("mem_rss_gb"))
    return [
        stage,
        t.get("step"),
        t.get("loss"),
        v.get("loss"),
        t.get("tokens_per_s"),
        t.get("tflops"),
        t.get("mfu"),
        mem,
        left_out(outputs or {}),
    ]


def eval_table(run_dir: Path) -> str:
    path = Path(run_dir) / "stages" / "eval" / "results.json"
    if not path.exists():
        return '<p class="muted">no eval results (stages/eval/results.json)</p>'
    data = json.loads(path.read_text())
    rows = [[name, *(res.get(k) for k in EVAL_COLUMNS)] for name, res in data.get("models", {}).items()]
    skipped = "".join(f"<li>{_esc(k)}: {_esc(v)}</li>" for k, v in data.get("skipped", {}).items())
    html = _table(["model", *EVAL_COLUMNS], rows, "eval-table") + (f"<ul>{skipped}</ul>" if skipped else "")
    cols, task_rows = task_grid(data.get("models", {}))
    if cols:  # lm-eval tasks: the models side by side, value ± standard error
        html += "<h3>lm-eval tasks</h3>" + _table(["model", *cols], task_rows, "eval-tasks")
    return html


# ---------------------------------------------------------------------------- timeline

END_EVENTS = {"completed": "#2ca02c", "failed": "#d62728", "requeued": "#ff7f0e", "stopped": "#ff7f0e"}


def attempts(events: list[dict[str, Any]], stage: str, now: float) -> list[dict[str, Any]]:
    """Each start of the stage's job and how it ended (completed, failed, requeued, stopped, or running)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.get("stage") != stage:
            continue
        if e.get("event") == "started":
            if out and out[-1]["end"] is None:
                out[-1].update(end=e["time"], how="lost")  # the job died without a word (node failure, kill)
            out.append({"start": e["time"], "end": None, "how": "running", "error": None})
        elif e.get("event") in END_EVENTS and out and out[-1]["end"] is None:
            out[-1].update(end=e["time"], how=e["event"], error=e.get("error"))
        elif e.get("event") == "failure_cause" and out:  # after the end, before the next start
            out[-1]["cause"] = f"{e.get('cause')}: {e.get('detail')}"
    for a in out:
        if a["end"] is None:
            a["end"] = now
    return out


def timeline(run_dir: Path, events: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]]) -> str:
    stages = [s for s in STAGES if any(e.get("stage") == s and e.get("event") == "started" for e in events)]
    if not stages:
        return '<p class="muted">no attempts recorded</p>'
    now = max(e["time"] for e in events)
    per = {s: attempts(events, s, now) for s in stages}
    t0 = min(a["start"] for s in stages for a in per[s])
    t1 = max([now] + [a["end"] for s in stages for a in per[s]])
    span = max(t1 - t0, 1e-6)
    left, w, row = 80, 900, 26
    h = row * len(stages) + 30

    def x(t: float) -> float:
        return left + (t - t0) / span * w

    parts = []
    for i, s in enumerate(stages):
        y = 8 + i * row
        parts.append(f'<text x="4" y="{y + 14}">{s}</text>')
        for a in per[s]:
            color = END_EVENTS.get(a["how"], "#1f77b4")
            tip = f"{s}: {a['how']} after {a['end'] - a['start']:.1f} s" + (
                f", cause {a['cause']}" if a.get("cause") else f" ({a['error']})" if a["error"] else ""
            )
            parts.append(
                f'<rect class="attempt" x="{x(a["start"]):.1f}" y="{y + 3}" width="{max(x(a["end"]) - x(a["start"]), 2):.1f}" '
                f'height="14" fill="{color}" opacity="0.55"><title>{_esc(tip)}</title></rect>'
            )
        for r in metrics.get(s, []):
            if r.get("kind") == "checkpoint" and "time" in r:
                tip = f"checkpoint step {r.get('step')} ({r.get('save_s', 0):.2f} s)"
                parts.append(
                    f'<line x1="{x(r["time"]):.1f}" x2="{x(r["time"]):.1f}" y1="{y + 1}" y2="{y + 19}" '
                    f'stroke="#333" stroke-width="1.5"><title>{_esc(tip)}</title></line>'
                )
            elif r.get("kind") in ("resume", "alarm") and "time" in r:
                color = "#9467bd" if r["kind"] == "resume" else "#d62728"
                tip = (
                    f"resumed at step {r.get('from_step')} ({r.get('steps_lost')} steps lost)"
                    if r["kind"] == "resume"
                    else f"alarm {r.get('alarm')}: {r.get('message')}"
                )
                parts.append(
                    f'<circle cx="{x(r["time"]):.1f}" cy="{y + 10}" r="4" fill="{color}"><title>{_esc(tip)}</title></circle>'
                )
    parts.append(f'<text x="{left}" y="{h - 4}">0 s</text>')
    parts.append(f'<text x="{left + w}" y="{h - 4}" text-anchor="end">{span:.0f} s</text>')
    legend = (
        "bars: attempts (green completed, red failed, orange requeued/stopped, blue running or lost); "
        "ticks: checkpoint saves; purple dots: resumes; red dots: alarms"
    )
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w + 10}" height="{h}">{"".join(parts)}</svg>'
    )
    return f'<div id="timeline">{svg}<p class="muted">{legend}</p></div>'


def accounting_rows(run_dir: Path, ledger: Ledger) -> list[list[Any]]:
    from pipeline.reporting.status import accounting

    rows = []
    for s in TRAIN_STAGES:
        rec = ledger.read(s)
        if rec is None:
            continue
        acc = accounting(run_dir, s)
        down = ", ".join(f"{d:.0f}s" for d in acc["down_s"]) or "-"
        rows.append(
            [
                s,
                rec.status,
                rec.attempts,
                rec.requeues,
                acc["resumes"],
                acc["steps_lost"],
                down,
                acc["checkpoints"],
                acc["checkpoint_save_s_total"],
            ]
        )
    return rows


def failures_table(ledger: Ledger) -> str:
    """Every failed attempt and its cause (StageRecord.failures, pipeline.records.causes)."""
    rows = [
        [s, f.get("attempt"), f.get("cause"), f.get("detail"), f.get("seen_by")]
        for s in STAGES
        if (r := ledger.read(s))
        for f in r.failures
    ]
    if not rows:
        return ""
    return "<h3>Failed attempts</h3>" + _table(
        ["stage", "attempt", "cause", "evidence", "seen by"], rows, "failures"
    )


# ---------------------------------------------------------------------------- pages


def _page(title: str, body: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
        f"<style>{CSS}</style><script>{ERROR_JS}</script></head><body>"
        f'<h1>{_esc(title)}</h1><p class="muted">written {stamp} by python -m pipeline.report</p>{body}</body></html>'
    )


def run_report(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    ledger = Ledger(run_dir)
    events = ledger.events()
    metrics = {s: read_metrics(run_dir, s) for s in STAGES}
    out = []
    status_rows = [
        [s, r.status, r.attempts, r.requeues, r.error or ""] for s in STAGES if (r := ledger.read(s))
    ]
    out.append(
        "<h2>Stages</h2>"
        + _table(["stage", "status", "attempts", "requeues", "error"], status_rows, "stages")
    )
    trained = [s for s in TRAIN_STAGES if any(r.get("kind") == "train" for r in metrics[s])]
    if trained:
        hdr = ["stage", "step", "train loss", "valid loss", "tokens/s", "TFLOP/s", "MFU", "memory GiB"]
        hdr.append("left out by truncation")
        rows = [stage_summary(s, metrics[s], (r.outputs if (r := ledger.read(s)) else {})) for s in trained]
        out.append("<h2>Training</h2>" + _table(hdr, rows, "train-summary"))
    out.append("<h2>Eval</h2>" + eval_table(run_dir))
    hdr = [
        "stage",
        "status",
        "attempts",
        "requeues",
        "resumes",
        "steps lost",
        "failure-to-training",
        "checkpoints",
        "save s",
    ]
    out.append(
        "<h2>Timeline</h2>"
        + timeline(run_dir, events, metrics)
        + _table(hdr, accounting_rows(run_dir, ledger), "accounting")
        + failures_table(ledger)
    )
    alarms = [
        [s, a.get("step"), a.get("alarm"), a.get("message")]
        for s in TRAIN_STAGES
        for a in read_alarms(run_dir, s)
    ]
    out.append(
        "<h2>Alarms</h2>"
        + (
            _table(["stage", "step", "alarm", "message"], alarms, "alarms")
            if alarms
            else '<p class="muted" id="no-alarms">none</p>'
        )
    )
    if trained:
        out.append("<h2>Curves</h2>")
    for s in trained:
        out.append(f"<h3>{s}</h3>" + stage_curves(s, metrics[s]))
    prov = run_dir / "provenance"
    for name, label in (
        ("config.yaml", "Resolved config"),
        ("git.json", "Code"),
        ("packages.json", "Packages"),
    ):
        p = prov / name
        if p.exists():
            out.append(f"<h2>{label}</h2><pre>{_esc(p.read_text())}</pre>")
    return _page(f"Run {run_dir.name}", "".join(out))


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "ledger").is_dir()


def trials(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir() and is_run_dir(p))


def trial_final(run_dir: Path) -> dict[str, Any]:
    """Final figures of one trial: last train/valid loss per training stage, eval metrics of its last model."""
    row: dict[str, Any] = {"trial": run_dir.name}
    for s in TRAIN_STAGES:
        recs = read_metrics(run_dir, s)
        if recs:
            row[f"{s} loss"] = _last(recs, "train").get("loss")
            row[f"{s} valid"] = _last(recs, "valid").get("loss")
    res = run_dir / "stages" / "eval" / "results.json"
    if res.exists():
        models = json.loads(res.read_text()).get("models", {})
        if models:
            name, m = list(models.items())[-1]
            row["eval model"] = name
            row["perplexity"] = m.get("perplexity")
            row["task acc"] = m.get("task_accuracy")
    return row


def _rank_key(row: dict[str, Any]) -> tuple[float, ...]:
    """Best first: lowest eval perplexity, else the lowest final valid (then train) loss of the last stage."""
    for k in (
        ["perplexity"]
        + [f"{s} valid" for s in reversed(TRAIN_STAGES)]
        + [f"{s} loss" for s in reversed(TRAIN_STAGES)]
    ):
        v = row.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return (0.0, float(v))
    return (1.0, 0.0)


def sweep_report(sweep_dir: Path) -> str:
    runs = trials(sweep_dir)
    rows = sorted((trial_final(r) for r in runs), key=_rank_key)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    out = [
        search_section(sweep_dir, _table),
        f"<h2>Trials ({len(rows)}), best first</h2>",
        _table(keys, [[r.get(k) for k in keys] for r in rows], "trials"),
    ]
    for s in TRAIN_STAGES:
        per = {r.name: read_metrics(r, s) for r in runs}
        if not any(per.values()):
            continue
        charts = []
        for key, title in CURVES[:2] + CURVES[3:]:
            series: list[Series] = [(name, *_series(recs, "train", key)) for name, recs in per.items()]
            charts.append(line_chart(f"{s}: {title}", series))
        charts.append(
            line_chart(f"{s}: valid loss", [(n, *_series(recs, "valid", "loss")) for n, recs in per.items()])
        )
        out.append(f"<h3>{s}</h3><div class='plots' id='curves-{s}'>{''.join(charts)}</div>")
    links = "".join(f'<li><a href="{_esc(r.name)}/report.html">{_esc(r.name)}</a></li>' for r in runs)
    out.append(f"<h2>Run reports</h2><ul>{links}</ul>")
    _ = PALETTE
    return _page(f"Sweep {Path(sweep_dir).resolve().name}", "".join(out))


def write_report(path: Path, out: Path | None = None) -> Path:
    """Write the run's (or the sweep folder's) report; returns the file (default <path>/report.html)."""
    path = Path(path)
    text = run_report(path) if is_run_dir(path) else sweep_report(path)
    target = Path(out) if out else path / "report.html"
    from pipeline.records.ledger import atomic_write_text

    atomic_write_text(target, text)
    return target
