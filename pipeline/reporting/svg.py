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


Line = tuple[Sequence[float | None], str]
"""(one value per axis, None where the line stops; its kind: 'best', 'completed' or 'pruned')."""
_LINE_STYLE = {
    "best": 'stroke="#d62728" stroke-width="2.4"',
    "completed": 'stroke="#1f77b4" stroke-width="1.2" stroke-opacity="0.7"',
    "pruned": 'stroke="#999" stroke-width="1" stroke-dasharray="4 3"',
}


def parallel_coordinates(
    title: str, axes: Sequence[str], lines: Sequence[Line], w: int = 520, h: int = 240
) -> str:
    """One vertical axis per name in ``axes`` (each scaled to its own min..max), one polyline per line across
    them, styled by its kind; a pruned trial's line stops at its last value. ``data-points``: values drawn."""
    left, right, top, bottom = 30, 30, 24, 40
    pw, ph = w - left - right, h - top - bottom
    body = [f'<text x="{w / 2}" y="15" class="title" text-anchor="middle">{html.escape(title)}</text>']
    cols: list[list[float]] = [
        [float(x) for v, _ in lines if i < len(v) and (x := v[i]) is not None] for i in range(len(axes))
    ]
    n = sum(len(c) for c in cols)
    span = [(min(c), max(c)) if c else (0.0, 1.0) for c in cols]
    step = pw / max(1, len(axes) - 1)

    def at(i: int, v: float) -> tuple[float, float]:
        lo, hi = span[i]
        frac = 0.5 if hi == lo else (v - lo) / (hi - lo)
        return left + i * step, top + (1 - frac) * ph

    for i, name in enumerate(axes):
        x = left + i * step
        lo, hi = span[i]
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" class="frame"/>')
        body.append(
            f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle">{html.escape(name[-22:])}</text>'
        )
        body.append(
            f'<text x="{x:.1f}" y="{top + ph + 27}" text-anchor="middle">{_fmt(lo)}..{_fmt(hi)}</text>'
        )
    order = sorted(lines, key=lambda line: ("pruned", "completed", "best").index(line[1]))  # best on top
    for values, kind in order:
        pts = [at(i, v) for i, v in enumerate(values) if v is not None]
        if len(pts) >= 2:
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            body.append(f'<polyline points="{coords}" fill="none" {_LINE_STYLE[kind]}/>')
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{"".join(body)}</svg>'
    return f'<figure class="plot" data-points="{n}" data-title="{html.escape(title)}">{svg}</figure>'
