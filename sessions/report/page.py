"""The report's `index.html`: one self-contained static page (inline CSS, no script).

Run names, session ids, messages and metric names are arbitrary user text: every one of them
goes through `html.escape` (quotes included) on its way into the page; figures are referenced
by their fixed file names, relative to the page.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from html import escape
from typing import Any

from sessions.report.data import ReportData, StepTable
from sessions.report.figures import FigureSpec
from sessions.report.text import visible

__all__ = ["GENERATOR", "render_page"]

#: The page's generator mark: how `report` knows a folder is its own earlier output.
GENERATOR = '<meta name="generator" content="rollout-ledger report">'

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1180px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.meta { color: #555; } .warn { background: #fff4e0; border-left: 4px solid #d95f02; padding: .5em .8em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; font-size: .92em; max-width: 60em; }
table { border-collapse: collapse; font-size: .9em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.msg { max-width: 32em; overflow-wrap: anywhere; white-space: pre-wrap; } code { font-size: .95em; }
"""


def _e(value: Any) -> str:
    """Any value as escaped HTML text ('—' for None), control characters shown as escapes."""
    return "—" if value is None else escape(visible(str(value)), quote=True)


def _num(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.4g}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[tuple[str, str]]]) -> str:
    """A table; each cell is (css class, already-escaped HTML)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{cls}">{html}</td>' if cls else f"<td>{html}</td>" for cls, html in row
        )
        + "</tr>\n"
        for row in rows
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def _when(value: datetime | None) -> str:
    return "—" if value is None else _e(value.strftime("%Y-%m-%d %H:%M:%S UTC"))


def _position(data: ReportData) -> str:
    p = data.positions
    text = (
        f"Read models projected up to position {p['projected']:,}; the log ended at position "
        f"{p['log_end']:,} when the report was read (this run: {p['run_events']:,} events, the last at "
        f"{p['run_last']:,})."
    )
    notes = []
    if p["run_last"] > p["projected"]:
        notes.append(
            "This run has events past the projector's checkpoint "
            f"({data.behind:,} event(s) of the log not projected): the figures stop at position "
            f"{p['projected']:,}. Run <code>rollout-ledger project</code> (or report again without "
            "<code>--no-project</code>) to bring them up to date."
        )
    open_now = {
        part: (t.last("sessions/open"), t.last("groups/unsettled"))
        for part, t in data.tables.items()
    }
    still = [
        f"{_e(part)}: {_num(s)} open session(s), {_num(g)} unsettled group(s) at its latest step"
        for part, (s, g) in open_now.items()
        if (s and not math.isnan(s)) or (g and not math.isnan(g))
    ]
    if still:
        notes.append(
            "The run is still being written (or was stopped mid-step): " + "; ".join(still) + "."
        )
    superseded = {
        part: sum(t.series("sessions/superseded", absent=0.0)) for part, t in data.tables.items()
    }
    resumed = [f"{_e(part)}: {_num(n)}" for part, n in superseded.items() if n]
    if resumed:
        notes.append(
            "The run was resumed: sessions of an earlier launch in steps a later launch re-ran are "
            "kept in the log but out of every figure (sessions/superseded; "
            + "; ".join(resumed)
            + ")."
        )
    return f'<p class="meta">{_e(text)}</p>' + "".join(f'<p class="warn">{n}</p>' for n in notes)


def _summary(tables: dict[str, StepTable]) -> str:
    rows = []
    for part, t in tables.items():
        honest, inflated = t.last("reward/mean"), t.last("reward/mean_success_only")
        gap = inflated - honest if not (math.isnan(honest) or math.isnan(inflated)) else math.nan
        total = sum(t.series("sessions/total", absent=0.0))
        failed = sum(t.series("sessions/failed", absent=0.0))
        rows.append(
            [
                ("", _e(part)),
                ("num", _num(len(t.steps))),
                ("num", f"{t.steps[0]}–{t.steps[-1]}"),
                ("num", _num(total)),
                ("num", _num(failed)),
                ("num", _num(honest)),
                ("num", _num(inflated)),
                ("num", _num(gap)),
                ("num", _num(t.last("coverage"))),
            ]
        )
    headers = [
        "partition",
        "steps",
        "step range",
        "sessions",
        "failed",
        "reward/mean (latest)",
        "reward/mean_success_only (latest)",
        "inflation (latest)",
        "coverage (latest)",
    ]
    return _table(headers, rows)


def _figure(spec: FigureSpec, src: str, max_points: int) -> str:
    caption = _e(spec.caption)
    if spec.steps_per_point > 1:
        caption += _e(
            f" Downsampled to at most {max_points} points per line: each point is {spec.steps_per_point} "
            "consecutive steps, drawn at their mean step with the mean of their values "
            "(the maximum for response_length/max)."
        )
    return (
        f'<figure id="{_e(spec.name)}"><img src="{_e(src)}" alt="{_e(spec.title)}" loading="lazy">'
        f"<figcaption><b>{_e(spec.title)}.</b> {caption}</figcaption></figure>"
    )


def _failures(failures: list[dict[str, Any]], limit: int) -> str:
    if not failures:
        return "<p>No failed session in this run.</p>"
    rows = []
    for f in failures:
        message, kind = f["message"] or "", f["error_type"]
        if kind and not message.startswith(kind):  # "TimeoutError()" already names its type
            message = f"{kind}: {message}"
        rows.append(
            [
                ("", f"<code>{_e(f['session_id'])}</code>"),
                ("num", _e(f["global_step"])),
                ("", _e(f["partition"])),
                ("", _e(f["failure_reason"])),
                ("msg", _e(message)),
                ("", "yes" if f["placeholder"] else "dropped"),
                ("", _when(f["terminal_at"])),
            ]
        )
    more = f"The {len(failures)} most recent" if len(failures) >= limit else f"All {len(failures)}"
    return (
        f"<p>{more} failed sessions, newest first (the <code>sessions</code> read model).</p>"
        + _table(["session", "step", "partition", "reason", "message", "placeholder", "when"], rows)
    )


def _all_metrics(tables: dict[str, StepTable]) -> str:
    names = sorted({n for t in tables.values() for n in t.values})
    headers = ["metric"] + [f"{p}: {what}" for p in tables for what in ("latest", "min", "max")]
    rows = []
    for name in names:
        row = [("", f"<code>{_e(name)}</code>")]
        for t in tables.values():
            present = [v for v in t.values.get(name, []) if not math.isnan(v)]
            row += [
                ("num", _num(t.last(name))),
                ("num", _num(min(present) if present else None)),
                ("num", _num(max(present) if present else None)),
            ]
        rows.append(row)
    return _table(headers, rows)


def _stepless(stepless: dict[str, dict[str, float]]) -> str:
    if not stepless:
        return ""
    rows = [
        [("", _e(p)), ("", f"<code>{_e(m)}</code>"), ("num", _num(v))]
        for p, metrics in stepless.items()
        for m, v in sorted(metrics.items())
    ]
    return (
        "<h2>Sessions recorded without a step</h2><p>Not in the figures (they have no step to draw at).</p>"
        + _table(["partition", "metric", "value"], rows)
    )


def render_page(
    data: ReportData, figures: list[tuple[FigureSpec, str]], *, max_points: int, failure_limit: int
) -> str:
    """The whole page; `figures` pairs each spec with its image file name beside the page."""
    title = f"rollout-ledger report: run {data.run}"
    parts = [
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n{GENERATOR}\n<title>{_e(title)}</title>',
        f"<style>{_CSS}</style>\n</head>\n<body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="meta">Generated {_when(data.generated_at)}.</p>',
        _position(data),
    ]
    if data.empty:
        parts.append(
            f'<p class="warn">Nothing of run {_e(repr(data.run))} is projected yet, so there is nothing to '
            "draw. Run <code>rollout-ledger project</code>, then report again.</p>"
        )
    else:
        if data.tables:
            parts += [
                "<h2>Summary</h2>",
                _summary(data.tables),
                "<p>reward/mean counts failures as zeros (the honest figure); reward/mean_success_only is the "
                "survivors-only figure other frameworks report; their difference is the inflation.</p>",
                "<h2>Figures</h2>",
            ]
            parts += [_figure(spec, src, max_points) for spec, src in figures]
        parts += ["<h2>Latest failures</h2>", _failures(data.failures, failure_limit)]
        if data.tables:
            parts += [
                "<h2>Every metric</h2><p>Every metric the run holds (all data sources together), at its "
                "latest step, and its smallest and largest value over the steps.</p>",
                _all_metrics(data.tables),
            ]
        parts.append(_stepless(data.stepless))
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)
