"""A search's part of the sweep report: the optimisation history (each trial's value and the best so far),
a parallel-coordinates plot (each trial's parameters and value; the best, completed and pruned ones apart),
the parameter importances, pruned against completed trials, and each trial's parameters, from ``<sweep>/.search/study.json`` (written by
the search controller after every trial it settles: pipeline.search.study.write_summary)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.reporting.svg import Line, line_chart, parallel_coordinates

Table = Callable[[Sequence[str], Sequence[Sequence[Any]]], str]


def search_section(sweep_dir: Path, table: Table) -> str:
    """The HTML of the study's section ('' for a sweep that is not a search)."""
    path = Path(sweep_dir) / ".search" / "study.json"
    if not path.is_file():
        return ""
    s = json.loads(path.read_text())
    rows = s["trials"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    keys = list(s.get("keys", []))
    header = ["trial", "state", "value", "best so far", "pruned at step", "slot s", *keys]
    body = [
        [r["number"], r["state"], r["value"], r["best"], r.get("pruned_step"), r.get("wall_s")]
        + [r["params"].get(k) for k in keys]
        for r in rows
    ]
    done = [r for r in rows if r["value"] is not None and r["state"] == "complete"]
    chart = line_chart(
        f"optimisation history ({s['direction']} {s['objective']})",
        [
            ("completed trial", [float(r["number"]) for r in done], [float(r["value"]) for r in done]),
            ("best so far", [float(r["number"]) for r in done], [float(r["best"]) for r in done]),
        ],
        xlabel="trial",
    )
    coords = parallel_coordinates(
        f"parameters and {s['objective']}", [*keys, s["objective"]], _lines(rows, keys, s.get("best"))
    )
    best = s.get("best")
    head = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    best_line = (
        f"<p>best: trial {best['number']}, {s['objective']} = {best['value']:.6g} "
        f"(<code>best.yaml</code>: the overrides that reproduce it)</p>"
        if best
        else "<p>no trial completed yet</p>"
    )
    return (
        f"<h2>Search: {len(rows)} of {s['n_trials']} trials ({head})</h2>{best_line}"
        f"<div class='plots' id='search-history'>{chart}{coords}</div>{_importance_table(s, table)}"
        f"{table(header, body)}"
    )


def _lines(rows: list[dict[str, Any]], keys: list[str], best: dict[str, Any] | None) -> list[Line]:
    """One line per completed or pruned trial: its parameters (a choice of strings by its index among the
    values seen) and, for a completed one, its value."""
    seen: dict[str, list[Any]] = {k: [] for k in keys}
    for r in rows:
        for k in keys:
            v = r["params"].get(k)
            if v is not None and not isinstance(v, int | float) and v not in seen[k]:
                seen[k].append(v)
    out: list[Line] = []
    for r in rows:
        if r["state"] not in ("complete", "pruned"):
            continue
        vals: list[float | None] = []
        for k in keys:
            v = r["params"].get(k)
            vals.append(
                float(v) if isinstance(v, int | float) else (seen[k].index(v) if v in seen[k] else None)
            )
        kind = "pruned" if r["state"] == "pruned" else "completed"
        if kind == "completed":
            vals.append(float(r["value"]))
            kind = "best" if best and r["number"] == best["number"] else kind
        out.append((vals, kind))
    return out


def _importance_table(s: dict[str, Any], table: Table) -> str:
    """Each key's share of the objective's variance (fANOVA over the completed trials), largest first."""
    imp = s.get("importances")
    if not imp:
        return ""
    rows = [[k, f"{v:.3f}"] for k, v in sorted(imp.items(), key=lambda kv: -kv[1])]
    return "<h3>Parameter importances (fANOVA)</h3>" + table(["key", "importance"], rows)
