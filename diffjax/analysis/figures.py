"""Paper-style figures for the analyses (and the benchmarks' results): a figure of side-by-side panels, and the
three kinds of panel the paper draws (heat maps, grouped bars, lines), one bar or line per checkpoint.

matplotlib is optional (the `plot` extra) and imported on the first figure. Figures are drawn on a
`matplotlib.figure.Figure`, which saves through the Agg canvas without pyplot: no global backend is chosen for the
caller (a notebook keeps its own) and no figure is left open.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

NOTE = "note: matplotlib is not installed (pip install 'diffjax[plot]'); the figure was not drawn"


class MatplotlibMissing(ImportError):
    """matplotlib cannot be imported; the message is NOTE."""


def panels(count: int, *, title: str, width: float = 4.6, height: float = 3.6):
    """(figure, [axes]): `count` panels side by side under one title."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MatplotlibMissing(NOTE) from None
    figure = Figure(figsize=(width * count, height), layout="constrained")
    axes = figure.subplots(1, count, squeeze=False)[0]
    figure.suptitle(title, fontsize=10)
    return figure, list(axes)


def save(figure, path: str | Path) -> None:
    figure.savefig(path, dpi=110)


def heatmap(figure, ax, grid_RC, *, rows: Sequence[str], columns: Sequence[str], title: str, xlabel: str,
            ylabel: str, vmin: float = 0.0, vmax: float = 1.0) -> None:
    """grid[r, c] as colour (red low, green high, the paper's Figure 5) with its value written in the cell."""
    grid_RC = np.asarray(grid_RC, dtype=float)
    image = ax.imshow(grid_RC, cmap="RdYlGn", vmin=vmin, vmax=vmax, aspect="auto")
    for (r, c), value in np.ndenumerate(grid_RC):
        ax.text(c, r, "n/a" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    figure.colorbar(image, ax=ax, fraction=0.05)


def bars(ax, categories: Sequence[str], series: Mapping[str, Sequence[float]], *, title: str, ylabel: str,
         xlabel: str = "", log: bool = False) -> None:
    """One group of bars per category, one bar per series (a checkpoint) in each group."""
    width = 0.8 / max(len(series), 1)
    positions = np.arange(len(categories))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(positions + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(positions, categories)
    ax.margins(y=0.35)  # room above the bars for the legend
    _finish(ax, title, xlabel, ylabel, log)


def lines(ax, x: Sequence, series: Mapping[str, Sequence[float]], *, title: str, ylabel: str, xlabel: str,
          categorical: bool = False, logx: bool = False, logy: bool = False) -> None:
    """One line (with markers) per series over x; categorical: x are labels at equal spacing."""
    positions = np.arange(len(x)) if categorical else np.asarray(x, dtype=float)
    for name, values in series.items():
        ax.plot(positions, np.asarray(values, dtype=float), "o-", label=name)
    if categorical:
        ax.set_xticks(positions, [str(value) for value in x])
    elif logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(positions, [str(value) for value in x])
    _finish(ax, title, xlabel, ylabel, logy)


def _finish(ax, title: str, xlabel: str, ylabel: str, log: bool) -> None:
    if log:  # ticks as plain numbers (0.5, 20, 300), not powers of ten
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else ""))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left" if log else "best", ncol=2 if len(ax.get_legend_handles_labels()[1]) > 2 else 1)
