"""Horizontal bar charts as standalone SVG, for the benchmarks' ``--svg`` option.

No plotting dependency: the chart is a few rectangles and labels, with a dashed line per
target, sized for the documentation site.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

__all__ = ["bar_chart"]

_ROW = 22
_LABEL = 230
_WIDTH = 640
_COLORS = ("#3f51b5", "#ff9800", "#009688", "#9c27b0")


def bar_chart(
    title: str,
    labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    targets: Sequence[tuple[str, float]] = (),
    unit: str = "",
) -> str:
    """An SVG chart: one group of bars per label, one bar per series, a dashed vertical line
    per target. Values are clipped at the axis maximum (the largest value or target)."""
    if not labels or not series or any(len(v) != len(labels) for _, v in series):
        raise ValueError("bar_chart needs labels and one value per label in every series")
    top = max([*(max(v) for _, v in series), *(t for _, t in targets), 1e-9]) * 1.1
    plot = _WIDTH - _LABEL - 20
    group = _ROW * len(series) + 8
    height = 60 + group * len(labels) + 20 * len(series)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
           f'viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    y0 = 40
    for i, label in enumerate(labels):
        y = y0 + i * group
        out.append(f'<text x="10" y="{y + group / 2:.0f}">{escape(label)}</text>')
        for j, (_, values) in enumerate(series):
            value = values[i]
            w = max(0.0, min(value, top)) / top * plot
            out.append(f'<rect x="{_LABEL}" y="{y + j * _ROW}" width="{w:.1f}" '
                       f'height="{_ROW - 4}" fill="{_COLORS[j % len(_COLORS)]}"/>')
            out.append(f'<text x="{_LABEL + w + 4:.1f}" y="{y + j * _ROW + 13}">'
                       f'{value:.2f}{escape(unit)}</text>')
    bottom = y0 + group * len(labels)
    for name, value in targets:
        x = _LABEL + value / top * plot
        out.append(f'<line x1="{x:.1f}" y1="{y0 - 6}" x2="{x:.1f}" y2="{bottom}" '
                   'stroke="#d32f2f" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x + 3:.1f}" y="{y0 - 8}" fill="#d32f2f">{escape(name)}</text>')
    for j, (name, _) in enumerate(series):
        y = bottom + 14 + j * 18
        out.append(f'<rect x="{_LABEL}" y="{y - 10}" width="12" height="12" '
                   f'fill="{_COLORS[j % len(_COLORS)]}"/>')
        out.append(f'<text x="{_LABEL + 18}" y="{y}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
