"""Terminal tables for the CLI (rich), with every stored value shown as stored.

Values from the database are user data: they become `rich.text.Text` (never markup), control
characters are written as escapes, binary as its length and a hex prefix, and long values are cut
with a marker that says how much was left out. A record tool that alters what it shows is lying.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from sessions.projection import metrics as m
from sessions.report.text import cut, visible

#: Longest text shown in a cell before it is cut (the rest is counted, not shown).
_MAX_CHARS = 200
__all__ = ["cut", "visible"]  # re-exported: the terminal's text rules live in sessions.report.text
#: Bytes of a binary value shown in hex.
_HEX_BYTES = 8


def shown(value: Any, *, limit: int = _MAX_CHARS) -> str:
    """One database value as the plain text a terminal shows (NULL, binary, text, numbers)."""
    if value is None:
        return "NULL"
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        more = "…" if len(data) > _HEX_BYTES else ""
        return f"<{len(data)} bytes> {data[:_HEX_BYTES].hex()}{more}" if data else "<0 bytes>"
    if isinstance(value, float):
        return repr(value)
    return cut(visible(str(value)), limit)


def cell(value: Any, *, limit: int = _MAX_CHARS) -> Text:
    """A table cell for a stored value: a `Text`, so rich never reads it as markup."""
    return Text(shown(value, limit=limit), style="dim" if value is None else "")


def label(text: str) -> Text:
    """Stored text used as a title or header (run names, data sources, column names)."""
    return Text(cut(visible(text), 80))


def json_value(value: Any) -> Any:
    """A JSON-safe form of a stored value: binary as `{"bytes": N, "hex": all of it}` (JSON is for programs)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return {"bytes": len(data), "hex": data.hex()}
    return value


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.4f}"


def _compact(title: str) -> Table:
    """A table without outer edges, so more of an 80-column terminal is left for values."""
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False
    )


def _number(table: Table, header: str) -> None:
    table.add_column(header, justify="right", no_wrap=True)


def _scope_key(scope: m.Scope) -> tuple[Any, ...]:
    run, partition, step, source = scope
    return (run, partition, -1 if step is None else step, source or "")


def _where(partition: str, step: int | None) -> Text:
    return Text(f"{partition} {'-' if step is None else step}")


def summary_table(rows: Sequence[m.MetricRow], title: str = "") -> RenderableType:
    """The demo's headline: narrow tables (sessions, failures, rewards, and attempts and policies
    when a run retried, excluded or kept partial work) per (partition, step).

    Each fits an 80-column terminal without cutting a figure; `title` (stored text: run and
    database) is printed above them as plain text. The rewards table shows the default rule
    (failures as zeros) whatever the metric policy; the policy's own figure sits beside the
    attempts, exclusions and partial rows that explain the difference.
    """
    from rich.console import Group

    scopes = sorted(
        ((k, v) for k, v in m.summarise(r for r in rows if r.data_source is None).items()),
        key=lambda kv: _scope_key(kv[0]),
    )
    sessions = _compact("sessions and groups")
    failures = _compact("failed sessions by reason")
    rewards = _compact("rewards (failed sessions count as 0.0)")
    for table in (sessions, failures, rewards):
        table.add_column("partition\nstep", no_wrap=True)
    for header in ("sessions", "succeeded", "failed", "cancelled", "groups", "unsettled"):
        _number(sessions, header)
    reasons = sorted({k for _, v in scopes for k in v if k.startswith("failed/")})
    _number(failures, "placeholders")
    for reason in reasons:
        _number(failures, reason.split("/", 1)[1])
    for header in (
        "reward/mean",
        "reward/mean\nsuccess_only",
        "reward/\nmean@N",
        "uids\nnot @N",
        "reward/mean\nper_uid",
    ):
        _number(rewards, header)
    for (_run, partition, step, _source), values in scopes:
        where = _where(partition, step)
        sessions.add_row(
            where,
            *(
                _fmt(values.get(name))
                for name in (
                    m.SESSIONS_TOTAL,
                    m.SESSIONS_SUCCEEDED,
                    m.SESSIONS_FAILED,
                    m.SESSIONS_CANCELLED,
                    m.GROUPS_TOTAL,
                    m.GROUPS_UNSETTLED,
                )
            ),
        )
        failures.add_row(
            where, _fmt(values.get(m.PLACEHOLDERS)), *(_fmt(values.get(r, 0.0)) for r in reasons)
        )
        headline = _headline(values)
        rewards.add_row(
            where,
            _fmt(values.get(m.REWARD_MEAN_DEFAULT_RULE, values.get(m.REWARD_MEAN))),
            _fmt(values.get(m.REWARD_MEAN_SUCCESS)),
            "-" if headline is None else f"@{headline[0]} {_fmt(headline[1])}",
            _fmt(values.get(m.UIDS_EXCLUDED)),
            _fmt(values.get(m.REWARD_MEAN_PER_UID)),
        )
    parts: list[RenderableType] = (
        [Text(visible(title))] if title else []
    )  # wrapped, never cut: it names the database
    tables: list[RenderableType] = [sessions, Text(""), failures, Text(""), rewards]
    if any(values.get(name) for _, values in scopes for name in _POLICY_FIGURES):
        tables += [Text(""), _policy_table(scopes)]
    return Group(*parts, *tables)


#: What the attempts-and-policies table shows, beside the default figures.
_POLICY_FIGURES = (m.SESSIONS_RETRIED, m.SESSIONS_EXCLUDED, m.ROWS_PARTIAL)


def _policy_table(scopes: list[tuple[m.Scope, dict[str, float]]]) -> Table:
    table = _compact("attempts and failure policies")
    table.add_column("partition\nstep", no_wrap=True)
    for header in (
        "attempts",
        "retried\nsessions",
        "excluded\nfailures",
        "partial\nrows",
        "reward/mean\npolicy",
        "reward/mean\ndefault",
    ):
        _number(table, header)
    for (_run, partition, step, _source), values in scopes:
        table.add_row(
            _where(partition, step),
            _fmt(values.get(m.ATTEMPTS, 0.0)),
            _fmt(values.get(m.SESSIONS_RETRIED, 0.0)),
            _fmt(values.get(m.SESSIONS_EXCLUDED, 0.0)),
            _fmt(values.get(m.ROWS_PARTIAL, 0.0)),
            _fmt(values.get(m.REWARD_MEAN)),
            _fmt(values.get(m.REWARD_MEAN_DEFAULT_RULE, values.get(m.REWARD_MEAN))),
        )
    return table


def _headline(values: dict[str, float]) -> tuple[int, float] | None:
    """verl's headline: `reward/mean@N` at the largest row count N of the scope (its `val-core`)."""
    at = [(int(k.split("@")[1]), v) for k, v in values.items() if k.startswith("reward/mean@")]
    return max(at) if at else None


def _metrics_tables(rows: Sequence[m.MetricRow]) -> list[Table]:
    """One table per (partition, step), a column per data source: metric names are never cut.

    A single wide table (a column per scope) cut every name and figure in an 80-column terminal.
    """
    scopes = m.summarise(rows)
    steps = sorted(
        {(s[0], s[1], s[2]) for s in scopes},
        key=lambda s: (s[0], s[1], -1 if s[2] is None else s[2]),
    )
    tables = []
    for run, partition, step in steps:
        sources = sorted((s for s in scopes if s[:3] == (run, partition, step)), key=_scope_key)
        names = sorted({name for s in sources for name in scopes[s]})
        table = _compact(f"{partition} step {'-' if step is None else step}")
        table.add_column("metric", no_wrap=True, min_width=max(len(n) for n in names))
        for source in sources:
            table.add_column(label(source[3] or "all sources"), justify="right", no_wrap=True)
        for name in names:
            table.add_row(label(name), *(_fmt(scopes[s].get(name)) for s in sources))
        tables.append(table)
    return tables


def metrics_table(rows: Sequence[m.MetricRow]) -> RenderableType:
    """Every metric of `rows`, one block per (partition, step) (see `_metrics_tables`)."""
    from rich.console import Group

    tables = _metrics_tables(rows)
    spaced: list[RenderableType] = []
    for table in tables:
        spaced += [table, Text("")]
    return Group(*spaced[:-1])


def history_table(session_id: str, rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title=label(f"session {session_id}"),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for header in ("pos", "ver", "recorded_at (UTC)", "type", "details"):
        table.add_column(
            header,
            justify="right" if header in ("pos", "ver") else "left",
            overflow="fold",
            no_wrap=header != "details",
        )
    for row in rows:
        table.add_row(
            *(
                cell(row[k], limit=1000)
                for k in ("position", "version", "recorded_at", "type", "details")
            )
        )
    return table


def rows_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """`sql`'s result: every value verbatim (see `cell`), cut only with a visible marker."""
    table = Table()
    for column in columns:
        table.add_column(label(column), overflow="fold")
    for row in rows:
        table.add_row(*(cell(v) for v in row))
    return table


class _Console(Console):
    """rich's console, except that a reader gone from stdout (`| head`) is a BrokenPipeError.

    rich itself exits with status 1 there; the CLI's handler (`sessions.cli.errors.guarded`)
    silences stdout and exits 141, as a shell reports a pipe closed early, whatever wrote last.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(32, "the reader of stdout went away")


def console() -> Console:
    """A console that does not squeeze tables to 80 columns when output is not a terminal (unless $COLUMNS says so)."""
    out = _Console()
    return out if out.is_terminal or os.environ.get("COLUMNS") else _Console(width=160)


def print_table(table: RenderableType, out: Console | None = None) -> None:
    show(table, out=out)


def show(*items: RenderableType | str, out: Console | None = None) -> None:
    """Print tables and lines; a `str` is plain text, never markup."""
    target = out or console()
    for item in items:
        target.print(Text(item) if isinstance(item, str) else item, soft_wrap=isinstance(item, str))


def print_json(data: Any) -> None:
    """JSON on stdout, flushed here so a closed pipe is reported while the CLI's handler is listening."""
    sys.stdout.write(json.dumps(data, default=str, indent=1) + "\n")
    sys.stdout.flush()


@contextmanager
def export_progress() -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on stderr for an export verb; yields its `advance(done, total)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]exporting"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("sessions", total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield advance


def print_summary(lines: Sequence[str], *, run_named: bool) -> None:
    """An export's summary lines, the first saying when the run was the most recent one."""
    chosen = "" if run_named else " (the most recent run; --run NAME for another)"
    print(lines[0] + chosen)
    for line in lines[1:]:
        print(line)
