"""Inline SVG line charts for the HTML report (no JavaScript, no network)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")

Series = tuple[str, Sequence[float], Sequence[float]]
"""(label, xs, ys)."""


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.2e}"
    return f"{v:.3g}"


def _finite(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[float, float]]:
    return [
        (float(x), float(y))
        for x, y in zip(xs, ys)
        if isinstance(y, (int, float))
        and isinstance(x, (int, float))
        and math.isfinite(y)
        and math.isfinite(x)
    ]


def line_chart(title: str, series: Sequence[Series], xlabel: str = "step", w: int = 400, h: int = 220) -> str:
    """One chart: a polyline (and point markers) per series, axes with min/max ticks, a legend.

    The figure carries ``data-points`` (points drawn) so a test can check every plot area is drawn.
    """
    pts = [(label, _finite(xs, ys)) for label, xs, ys in series]
    pts = [(label, p) for label, p in pts if p]
    n = sum(len(p) for _, p in pts)
    left, right, top, bottom = 58, 12, 24, 36
    pw, ph = w - left - right, h - top - bottom
    body = [f'<text x="{w / 2}" y="15" class="title" text-anchor="middle">{html.escape(title)}</text>']
    if not pts:
        body.append(f'<text x="{w / 2}" y="{h / 2}" text-anchor="middle" class="empty">no data</text>')
    else:
        allx = [x for _, p in pts for x, _ in p]
        ally = [y for _, p in pts for _, y in p]
        x0, x1 = min(allx), max(allx)
        y0, y1 = min(ally), max(ally)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        if y1 == y0:
            pad = abs(y0) * 0.05 or 1.0
            y0, y1 = y0 - pad, y1 + pad

        def sx(x: float) -> float:
            return left + (x - x0) / (x1 - x0) * pw

        def sy(y: float) -> float:
            return top + (1 - (y - y0) / (y1 - y0)) * ph

        body.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
        for v in (y0, (y0 + y1) / 2, y1):
            yy = sy(v)
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>')
            body.append(f'<text x="{left - 4}" y="{yy + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
        for v in (x0, x1):
            body.append(f'<text x="{sx(v):.1f}" y="{top + ph + 14}" text-anchor="middle">{_fmt(v)}</text>')
        body.append(
            f'<text x="{left + pw / 2}" y="{h - 4}" text-anchor="middle">{html.escape(xlabel)}</text>'
        )
        for i, (label, p) in enumerate(pts):
            color = PALETTE[i % len(PALETTE)]
            coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
            body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.6"/>')
            for x, y in p if len(p) <= 40 else ():
                body.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}"/>')
            ly = top + 12 + 13 * i
            body.append(f'<rect x="{left + pw - 120}" y="{ly - 8}" width="9" height="9" fill="{color}"/>')
            body.append(f'<text x="{left + pw - 107}" y="{ly}">{html.escape(label[:18])}</text>')
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{"".join(body)}</svg>'
    return f'<figure class="plot" data-points="{n}" data-title="{html.escape(title)}">{svg}</figure>'
