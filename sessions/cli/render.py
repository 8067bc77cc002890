"""Terminal tables for the CLI (rich)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from sessions.projection import metrics as m

SUMMARY_COLUMNS = (
    ("sessions", m.SESSIONS_TOTAL),
    ("ok", m.SESSIONS_SUCCEEDED),
    ("failed", m.SESSIONS_FAILED),
    ("cancel", m.SESSIONS_CANCELLED),
    ("placeh.", m.PLACEHOLDERS),
    ("groups", m.GROUPS_TOTAL),
    ("unsettled", m.GROUPS_UNSETTLED),
    ("reward/mean", m.REWARD_MEAN),
    ("reward/mean\nsuccess_only", m.REWARD_MEAN_SUCCESS),
)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.4f}"


def summary_table(rows: Sequence[m.MetricRow], title: str) -> Table:
    """One line per (partition, step) over all data sources: the demo's headline table."""
    scopes = m.summarise(r for r in rows if r.data_source is None)
    table = Table(title=title)
    table.add_column("partition")
    table.add_column("step", justify="right")
    for header, _ in SUMMARY_COLUMNS:
        table.add_column(header, justify="right")
    table.add_column("reward/\nmean@N", justify="right")
    table.add_column("uids\nnot @N", justify="right")
    table.add_column("reward/\nmean_per_uid", justify="right")
    table.add_column("failed by reason", overflow="fold")
    for (run, partition, step, _source), values in sorted(scopes.items(), key=lambda kv: (kv[0][1], kv[0][2] or -1)):
        headline = _headline(values)
        reasons = " ".join(f"{k.split('/', 1)[1]}={int(v)}" for k, v in sorted(values.items()) if k.startswith("failed/"))
        table.add_row(
            partition, "-" if step is None else str(step),
            *(_fmt(values.get(name)) for _, name in SUMMARY_COLUMNS),
            "-" if headline is None else f"@{headline[0]} {_fmt(headline[1])}",
            _fmt(values.get(m.UIDS_EXCLUDED)), _fmt(values.get(m.REWARD_MEAN_PER_UID)), reasons or "-",
        )
    return table


def _headline(values: dict[str, float]) -> tuple[int, float] | None:
    """verl's headline: `reward/mean@N` at the largest row count N of the scope (its `val-core`)."""
    at = [(int(k.split("@")[1]), v) for k, v in values.items() if k.startswith("reward/mean@")]
    return max(at) if at else None


def metrics_table(rows: Sequence[m.MetricRow]) -> Table:
    scopes = m.summarise(rows)
    names = sorted({r.metric for r in rows})
    table = Table(title="metric counts")
    table.add_column("metric")
    ordered = sorted(scopes, key=lambda s: (s[0], s[1], -1 if s[2] is None else s[2], s[3] or ""))
    for run, partition, step, source in ordered:
        table.add_column(f"{partition} step {step}\n{source or 'all'}", justify="right")
    for name in names:
        table.add_row(name, *(_fmt(scopes[s].get(name)) for s in ordered))
    return table


def history_table(session_id: str, rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(title=f"session {session_id}")
    for header in ("pos", "ver", "recorded_at (UTC)", "type", "details"):
        table.add_column(header, justify="right" if header in ("pos", "ver") else "left")
    for row in rows:
        table.add_row(str(row["position"]), str(row["version"]), row["recorded_at"], row["type"], row["details"])
    return table


def console() -> Console:
    """A console that does not squeeze tables to 80 columns when output is not a terminal."""
    out = Console()
    return out if out.is_terminal else Console(width=160)


def print_table(table: Table, out: Console | None = None) -> None:
    (out or console()).print(table)
