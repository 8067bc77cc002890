"""Drawing a `FigureSpec` to a PNG with matplotlib's Agg canvas.

matplotlib is the optional `report` extra: it is imported here, on first use, and its absence
is one line naming the extra. The canvas is Agg's own (`FigureCanvasAgg` on a bare `Figure`),
so nothing touches pyplot's global state or needs a display.

Three rules of reading a chart, held by `tests/report/test_report.py` on the figure objects:

- an axis of counts or lengths starts at 0 (`Panel.zero_based`): on an axis from 3.77 to 4.0 a
  0.15-token dip fills the panel and reads as a crash;
- the legend sits below the panels, one per figure (a label has one color across a figure), so
  it never covers a point;
- what is drawn in layers: filled areas (stacks, the shaded gap) at the bottom, solid lines above
  them, dashed lines on top, so a dashed line is never hidden under a fill or a solid line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sessions.errors import LedgerError
from sessions.report.figures import FigureSpec, Panel

__all__ = ["draw", "render", "require_matplotlib"]

#: Honest mean, success-only mean, and the inflation between them.
HONEST, SUCCESS_ONLY, GAP = "#1f4e79", "#d95f02", "#fdb863"
#: Up to this many points a stacked series is drawn as bars (readable for a short run).
_BARS_UP_TO = 40
#: The layers, bottom to top: filled areas, solid lines, dashed lines (matplotlib's defaults put
#: patches at 1 and lines at 2; these are explicit so the order is a rule, not a default).
FILL_Z, LINE_Z, DASHED_Z = 1.0, 2.0, 3.0
#: Most legend entries per row below a figure.
_LEGEND_COLUMNS = 4


class _MissingReportDependency(LedgerError):
    """The report needs matplotlib, which is the `report` extra."""


def require_matplotlib() -> Any:
    """matplotlib, or a one-line error saying how to install it."""
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise _MissingReportDependency(
            "the report draws its figures with matplotlib, which is not installed: install the report extra "
            "from the clone, pip install -e '.[report]'"
        ) from error
    return matplotlib


def draw(spec: FigureSpec, path: Path, *, dpi: int = 100) -> Path:
    """Draw `spec` to `path` (PNG) and return it."""
    render(spec, dpi=dpi).savefig(path, format="png", dpi=dpi)
    return path


def render(spec: FigureSpec, *, dpi: int = 100) -> Any:
    """`spec` as a matplotlib `Figure` on an Agg canvas (not yet saved): what `draw` writes, for
    a caller or a test that reads the figure's objects rather than its pixels."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols = len(spec.rows), max(len(r) for r in spec.rows)
    figure = Figure(figsize=(5.2 * cols, 3.0 * rows + 0.9), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(spec.title, fontsize=12)
    grid = figure.subplots(rows, cols, squeeze=False)
    colors = _colors(spec)
    for r, row in enumerate(spec.rows):
        for c in range(cols):
            axes = grid[r][c]
            if c < len(row):
                _panel(axes, row[c], colors)
            else:
                axes.set_visible(False)
    _legend_below(figure, grid)
    return figure


def _legend_below(figure: Any, grid: Any) -> None:
    """One legend for the figure, below its panels (constrained layout keeps it outside them):
    every label once, in the order the panels first draw it."""
    entries: dict[str, Any] = {}
    for axes in grid.flat:
        handles, labels = axes.get_legend_handles_labels()
        for handle, label in zip(handles, labels):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(
            list(entries.values()),
            list(entries),
            loc="outside lower center",
            ncols=min(len(entries), _LEGEND_COLUMNS),
            fontsize=7,
            frameon=False,
        )


def _colors(spec: FigureSpec) -> dict[str, str]:
    """One color per series label across the figure, so a reason is the same color in every panel."""
    palette = [
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
    ]
    colors = {"reward/mean": HONEST, "reward/mean_success_only": SUCCESS_ONLY}
    for row in spec.rows:
        for panel in row:
            for s in panel.series:
                if s.label not in colors:
                    colors[s.label] = palette[(len(colors) - 2) % len(palette)]
    return colors


def _panel(axes: Any, panel: Panel, colors: dict[str, str]) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.set_title(panel.title, fontsize=10)
    blank = all(
        math.isnan(v) for s in panel.series for v in s.y
    )  # e.g. a mean that never had a denominator
    if panel.note is not None or blank:
        axes.text(
            0.5,
            0.5,
            panel.note or "nothing recorded",
            ha="center",
            va="center",
            fontsize=12,
            color="#666666",
            transform=axes.transAxes,
        )
        axes.set_xticks([])
        axes.set_yticks([])
        return
    x = panel.series[0].x
    few = len(x) <= _BARS_UP_TO
    marker = "o" if few else None
    stacks = [s for s in panel.series if s.style == "stack"]
    if stacks:
        heights = [[0.0 if math.isnan(v) else v for v in s.y] for s in stacks]
        if few:
            width = 0.8 * (min(b - a for a, b in zip(x, x[1:])) if len(x) > 1 else 1.0)
            bottom = [0.0] * len(x)
            for s, h in zip(stacks, heights):
                axes.bar(
                    s.x,
                    h,
                    width=width,
                    bottom=bottom,
                    label=s.label,
                    color=colors[s.label],
                    zorder=FILL_Z,
                )
                bottom = [a + b for a, b in zip(bottom, h)]
        else:
            axes.stackplot(
                x,
                *heights,
                labels=[s.label for s in stacks],
                colors=[colors[s.label] for s in stacks],
                zorder=FILL_Z,
            )
    if panel.gap is not None:
        low, high = panel.get(panel.gap[0]), panel.get(panel.gap[1])
        if low is not None and high is not None:
            axes.fill_between(
                low.x,
                low.y,
                high.y,
                color=GAP,
                alpha=0.55,
                linewidth=0,
                label="inflation (success-only − honest)",
                zorder=FILL_Z,
            )
    for s in panel.series:
        if s.style == "stack":
            continue
        dashed = s.style == "dashed"
        axes.plot(
            s.x,
            s.y,
            label=s.label,
            color=colors.get(s.label),
            linestyle="--" if dashed else "-",
            marker=marker,
            markersize=3,
            linewidth=1.6,
            zorder=DASHED_Z if dashed else LINE_Z,
        )
    if panel.ylim is not None:
        axes.set_ylim(*panel.ylim)
    elif panel.zero_based:
        # 0 counted as data, so the top's margin is a share of the whole axis and the highest
        # line stays off the frame; then the axis starts at 0 (at least 1 high: all-zero data)
        axes.update_datalim([(x[0], 0.0)])
        axes.autoscale_view()
        axes.set_ylim(0.0, max(axes.get_ylim()[1], 1.0))
    axes.set_xlabel("global step", fontsize=8)
    axes.set_ylabel(panel.ylabel, fontsize=8)
    axes.tick_params(labelsize=7)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    axes.grid(alpha=0.3)
    axes.set_axisbelow(True)  # the grid under the data
