"""The benchmarks' charts (``--svg``): grouped horizontal bars with axes, ticks and target
lines, drawn by matplotlib (the ``bench`` extra: ``pip install 'kvspec[bench]'``)."""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Sequence

__all__ = ["MISSING", "bar_chart"]

MISSING = ("--svg needs matplotlib, which kvspec's 'bench' extra installs: "
           "pip install 'kvspec[bench]'")
"""What to tell a user whose environment has no matplotlib; empty when it has one."""
if importlib.util.find_spec("matplotlib") is not None:
    MISSING = ""


def bar_chart(
    title: str,
    labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    targets: Sequence[tuple[str, float]] = (),
    xlabel: str = "ratio",
) -> str:
    """An SVG chart: one group of bars per label (top to bottom in the given order), one bar
    per series, each bar labelled with its value, and a dashed vertical line per target
    named in the legend. The SVG carries no date, so reruns with equal numbers are equal.

    Raises:
        ValueError: no labels or series, or a series without one value per label.
        ModuleNotFoundError: matplotlib is not installed (``MISSING`` says so).
    """
    if not labels or not series or any(len(v) != len(labels) for _, v in series):
        raise ValueError("bar_chart needs labels and one value per label in every series")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "kvspec"
    matplotlib.rcParams["svg.fonttype"] = "none"  # real <text>: small, searchable
    n = len(series)
    height = 0.8 / n
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * len(labels) * n))
    try:
        for j, (name, values) in enumerate(series):
            ys = [i + (j - (n - 1) / 2) * height for i in range(len(labels))]
            bars = ax.barh(ys, values, height=height * 0.9, label=name)
            ax.bar_label(bars, fmt="%.2f", padding=3, fontsize=8)
        for k, (name, value) in enumerate(targets):
            ax.axvline(value, color="#d32f2f", linestyle=(0, (4, 3)), linewidth=1,
                       label=f"target {name}", alpha=0.9 - 0.2 * k)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        top = max([*(max(v) for _, v in series), *(t for _, t in targets)])
        ax.set_xlim(0, top * 1.18)
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, loc="lower right", framealpha=0.95)
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None})
        return out.getvalue()
    finally:
        plt.close(fig)
