"""Line charts as inline SVG text, drawn by hand for the run's report (``anyfit.training.report``).

Why not matplotlib, as ``loss.png`` is drawn: the report is written at the end of every run, the test suite's
hundred tiny runs included. Measured on a 2-core VM: matplotlib costs 0.7 s to import and 0.35 s per figure
of three small plots (then base64 inside the page); these charts cost about a millisecond each and stay sharp at
any zoom. A few polylines with axes, ticks and a legend need nothing more.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

# matplotlib's tab10, so the page's colours match loss.png's
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
WIDTH, HEIGHT = 360, 260
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 30, 64  # margins: tick labels left, title above, axis label and legend below


@dataclass(frozen=True)
class Series:
    """One line of a chart: ``(x, y)`` points; ``markers`` for sparse series (evaluations), ``dashed`` for a
    reference (what the plan predicted)."""

    label: str
    points: list[tuple[float, float]]
    markers: bool = False
    dashed: bool = False


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[low, high]``: steps of 1, 2 or 5 times a power of ten."""
    if not high > low:  # one value: a range around it (from 0 up, for a 0)
        pad = 0.5 * (abs(high) or 1.0)
        low, high = (low - pad if low else 0.0), high + pad
    raw = (high - low) / max(1, count)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    ticks = [round(math.floor(low / step) * step, 12)]
    while ticks[-1] < high:  # the last tick at or above the highest value: every point inside the frame
        ticks.append(round(ticks[0] + len(ticks) * step, 12))
    return ticks


def thin(points: list[tuple[float, float]], buckets: int = WIDTH - LEFT - RIGHT) -> list[tuple[float, float]]:
    """At most two points per pixel column: each run of points keeps its lowest and highest, in order, so a
    long run's spikes still show while its page stays small (20,000 logged steps: over a megabyte without)."""
    if len(points) <= 2 * buckets:
        return points
    size = len(points) / buckets
    kept = []
    for b in range(buckets):
        chunk = points[round(b * size):round((b + 1) * size)]
        by_value = sorted(range(len(chunk)), key=lambda i: chunk[i][1])
        kept.extend(chunk[i] for i in sorted({by_value[0], by_value[-1]}))
    return kept


def tick_text(value: float) -> str:
    """A tick label short enough for the margin."""
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.3g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")
    return f"{value:.6g}"


def line_chart(title: str, series: list[Series], y_label: str, x_label: str = "optimizer step",
               y_floor: float | None = None, y_ceiling: float | None = None) -> str:
    """An ``<svg>`` element: the series against a shared x axis, ticks and grid, a legend below. Points that
    are not finite are left out. ``y_floor``/``y_ceiling`` fix an end of the y axis (0 and 1 for a share)."""
    series = [Series(s.label, thin([(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)]),
                     s.markers, s.dashed) for s in series]
    series = [s for s in series if s.points]
    xs = [x for s in series for x, _ in s.points] or [0.0, 1.0]
    ys = [y for s in series for _, y in s.points] or [0.0, 1.0]
    x_ticks = nice_ticks(min(xs), max(xs))
    y_ticks = nice_ticks(min(ys) if y_floor is None else y_floor, max(ys) if y_ceiling is None else y_ceiling)
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - (y - y0) / ((y1 - y0) or 1.0) * plot_h

    parts = [f'<text x="{WIDTH / 2:.0f}" y="18" text-anchor="middle" class="title">{html.escape(title)}</text>']
    for t in y_ticks:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>'
                     f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{tick_text(t)}</text>')
    for t in x_ticks:
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{TOP}" y2="{TOP + plot_h}" class="grid"/>'
                     f'<text x="{px(t):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{tick_text(t)}</text>')
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{TOP + plot_h + 32}" text-anchor="middle">'
                 f'{html.escape(x_label)}</text>')
    parts.append(f'<text transform="translate(14 {TOP + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">'
                 f'{html.escape(y_label)}</text>')
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.8"{dash}/>')
        if s.markers or len(s.points) == 1:
            parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}">'
                         f'<title>{html.escape(s.label)} at {tick_text(x)}: {y:.6g}</title></circle>'
                         for x, y in s.points)
    legend, rows = _legend(series, TOP + plot_h + 48)
    height = HEIGHT + 14 * max(0, rows - 1)  # a long legend wraps: the picture grows instead of cutting it
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
            f'height="{height}" role="img" aria-label="{html.escape(title)}">{"".join(parts)}{legend}</svg>')


def _legend(series: list[Series], y: float) -> tuple[str, int]:
    """The series' names in rows under the x axis label; ``(svg, rows)``."""
    parts, x, row = [], float(LEFT), 0
    for i, s in enumerate(series):
        width = 30 + 6.5 * len(s.label)
        if x + width > WIDTH - RIGHT and x > LEFT:
            x, row = float(LEFT), row + 1
        top = y + 14 * row
        colour = PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        parts.append(f'<line x1="{x:.0f}" x2="{x + 20:.0f}" y1="{top:.0f}" y2="{top:.0f}" stroke="{colour}" '
                     f'stroke-width="2"{dash}/><text x="{x + 25:.0f}" y="{top + 4:.0f}">{html.escape(s.label)}</text>')
        x += width
    return "".join(parts), row + 1
