"""A search's part of the sweep report: the optimisation history (each trial's value and the best so far),
pruned against completed trials, and each trial's parameters, from ``<sweep>/.search/study.json`` (written by
the search controller after every trial it settles: pipeline.search.study.write_summary)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.reporting.svg import line_chart

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
        f"<div class='plots' id='search-history'>{chart}</div>{table(header, body)}"
    )
