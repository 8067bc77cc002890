"""Writing a report folder: `index.html` and one PNG per figure beside it.

The folder is filled beside its target and swapped in whole (`sessions.export.outputs`): a report
killed mid-draw leaves the previous report as it was, never the new run's figures under the old
page. What the swap replaces must be a report (only `index.html` and PNGs, the page marked as
ours) or an empty folder, so nothing else a user keeps there can be lost.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sessions.export.outputs import OutputRefused, check_target, holds_ledger, replaced_folder
from sessions.report.data import FAILURE_ROWS, ReportData
from sessions.report.downsample import MAX_POINTS
from sessions.report.drawing import draw, require_matplotlib
from sessions.report.figures import FigureSpec, plan_figures
from sessions.report.page import GENERATOR, render_page

__all__ = ["DEFAULT_DPI", "check_out", "write_report"]

DEFAULT_DPI = 100


@dataclass
class _ReportFiles:
    """What was written, and the series each figure was drawn from (for tests and callers)."""

    index: Path
    figures: list[tuple[FigureSpec, Path]] = field(default_factory=list)
    seconds: float = 0.0

    def figure(self, name: str) -> FigureSpec:
        return next(spec for spec, _ in self.figures if spec.name == name)


def _only_report_files(out: Path) -> bool:
    return all(
        entry.is_file() and (entry.name == "index.html" or entry.suffix == ".png")
        for entry in out.iterdir()
    )


def _is_report_folder(out: Path) -> bool:
    """An empty folder, or one holding only a report this verb wrote (its page says so)."""
    if not out.is_dir() or not _only_report_files(out):
        return False
    page = out / "index.html"
    if not page.exists():
        return not any(out.iterdir())
    with open(page, encoding="utf-8", errors="replace") as file:
        return GENERATOR in file.read(4096)


def check_out(out: Path, *, databases: Sequence[str | None] = (), force: bool = False) -> None:
    """Refuse, in one line, an --out that is a file or cannot be created or written, a ledger,
    or a folder holding anything but a report (``force`` lifts only the report's own mark)."""
    if out.is_dir() and not _only_report_files(out):
        raise OutputRefused(
            f"--out {out} holds files a report does not make; the report replaces its folder "
            "whole, so pass a new or empty folder"
        )
    if out.exists() and not out.is_dir() and not holds_ledger(out):
        raise OutputRefused(
            f"--out {out} is a file, not a folder: pass a folder for index.html and its figures "
            "(it is created if missing)"
        )
    check_target(out, flag="--out", databases=databases, force=force, made_here=_is_report_folder)
    existing = out.parent
    while not existing.exists():  # the nearest folder that exists is the one we must write into
        existing = existing.parent
    if not existing.is_dir():
        raise OutputRefused(
            f"--out {out}: {existing} is a file, so the folder cannot be created there; pass another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputRefused(
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
    force: bool = False,
) -> _ReportFiles:
    """Draw every figure into `out` (created if missing), then write `index.html` last, so a page
    on disk never names a figure that is not there yet."""
    started = time.perf_counter()
    check_out(out, force=force)
    specs = plan_figures(data.tables, max_points=max_points)
    if specs:
        require_matplotlib()
    out.parent.mkdir(parents=True, exist_ok=True)
    files = _ReportFiles(out / "index.html")
    with replaced_folder(out) as folder:
        for spec in specs:
            draw(spec, folder / f"{spec.name}.png", dpi=dpi)
            files.figures.append((spec, out / f"{spec.name}.png"))
        page = render_page(
            data,
            [(spec, path.name) for spec, path in files.figures],
            max_points=max_points,
            failure_limit=failure_limit,
        )
        (folder / "index.html").write_text(page, encoding="utf-8")
    files.seconds = time.perf_counter() - started
    return files
