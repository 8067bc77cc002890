"""Writing a report folder: `index.html` and one PNG per figure beside it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sessions.report.data import FAILURE_ROWS, ReportData
from sessions.report.downsample import MAX_POINTS
from sessions.report.drawing import draw, require_matplotlib
from sessions.report.figures import FigureSpec, plan_figures
from sessions.report.page import render_page

__all__ = ["DEFAULT_DPI", "ReportFiles", "check_out", "write_report"]

DEFAULT_DPI = 100


@dataclass
class ReportFiles:
    """What was written, and the series each figure was drawn from (for tests and callers)."""

    index: Path
    figures: list[tuple[FigureSpec, Path]] = field(default_factory=list)
    seconds: float = 0.0

    def figure(self, name: str) -> FigureSpec:
        return next(spec for spec, _ in self.figures if spec.name == name)


def check_out(out: Path) -> None:
    """Refuse, in one line, an --out that is a file or cannot be created or written."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {out} is a file, not a folder: pass a folder for index.html and its figures "
            "(it is created if missing)"
        )
    existing = out
    while not existing.exists():  # the nearest folder that exists is the one we must write into
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"--out {out}: {existing} is a file, so the folder cannot be created there; pass another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"--out {out}: folder {existing} is not writable by this process; pass a folder you may "
            "write, or fix its permissions"
        )


def write_report(
    data: ReportData,
    out: Path,
    *,
    dpi: int = DEFAULT_DPI,
    max_points: int = MAX_POINTS,
    failure_limit: int = FAILURE_ROWS,
) -> ReportFiles:
    """Draw every figure into `out` (created if missing), then write `index.html` last, so a page
    on disk never names a figure that is not there yet."""
    started = time.perf_counter()
    check_out(out)
    specs = plan_figures(data.tables, max_points=max_points)
    if specs:
        require_matplotlib()
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out / "index.html")
    for spec in specs:
        files.figures.append((spec, draw(spec, out / f"{spec.name}.png", dpi=dpi)))
    page = render_page(
        data,
        [(spec, path.name) for spec, path in files.figures],
        max_points=max_points,
        failure_limit=failure_limit,
    )
    partial = out / ".index.html.tmp"
    partial.write_text(page, encoding="utf-8")
    os.replace(partial, files.index)
    files.seconds = time.perf_counter() - started
    return files
