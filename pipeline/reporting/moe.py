"""The report's Mixture-of-Experts charts: load-balancing and z-loss, each MoE layer's busiest and idlest
expert (share of the layer's tokens) and routing entropy, dropped tokens (engine.models.moe writes them
into the train lines). Nothing for a dense model."""

from __future__ import annotations

import re
from typing import Any

from pipeline.reporting.svg import Series, line_chart

_LAYER = re.compile(r"^moe_layer(\d+)_tokens_max$")
LOSSES = (("moe_aux_loss", "load-balancing loss"), ("moe_z_loss", "router z-loss"))


def _series(recs: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    sel = [r for r in recs if r.get("kind") == "train" and isinstance(r.get(key), (int, float))]
    return [float(r["step"]) for r in sel], [float(r[key]) for r in sel]


def moe_layers(recs: list[dict[str, Any]]) -> list[int]:
    """The MoE layers the train lines report on (sorted)."""
    return sorted({int(m.group(1)) for r in recs for k in r if (m := _LAYER.match(k))})


def moe_charts(stage: str, recs: list[dict[str, Any]]) -> list[str]:
    """The MoE charts of one stage's metrics (empty for a dense model)."""
    layers = moe_layers(recs)
    if not layers:
        return []
    charts = [
        line_chart(f"{stage}: {title}", [("train", *_series(recs, key))])
        for key, title in LOSSES
        if _series(recs, key)[0]
    ]
    for what, title in (
        ("max", "busiest expert, share of tokens"),
        ("min", "idlest expert, share of tokens"),
    ):
        series: list[Series] = [(f"layer {i}", *_series(recs, f"moe_layer{i}_tokens_{what}")) for i in layers]
        charts.append(line_chart(f"{stage}: {title}", series))
    entropy: list[Series] = [(f"layer {i}", *_series(recs, f"moe_layer{i}_tokens_entropy")) for i in layers]
    charts.append(line_chart(f"{stage}: routing entropy (1 = balanced)", entropy))
    charts.append(
        line_chart(f"{stage}: dropped tokens (fraction)", [("train", *_series(recs, "moe_dropped_frac"))])
    )
    return charts
