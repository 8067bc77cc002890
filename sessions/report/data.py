"""What the report shows, read once: a run's metrics per partition and step, its latest
failures, and how far the projector had read the log.

The figures use the all-data-sources scope (`data_source` NULL) of each step; per-source
numbers stay in `rollout-ledger metrics` and the `reward_by_step` view. Beside the stored
metrics, each step's wasted call tokens (`wasted_tokens/<cause>/<reason>`, read from the call
views: `docs/failures.md`, "What failures cost").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sessions.errors import NotFound
from sessions.events import DEFAULT_MIN_VALID
from sessions.vocabulary import PARTITIONS
from store import AsyncEngine, report_failures, report_positions, report_step_metrics
from store import read_models as rm

__all__ = ["FAILURE_ROWS", "ReportData", "StepTable", "gather", "step_tables"]

#: Failed sessions listed in the page's table, newest first.
FAILURE_ROWS = 50


@dataclass
class StepTable:
    """One partition's metrics by step: `values[metric][i]` is the value at `steps[i]`, NaN where
    the metric has no row at that step (a counter never incremented, a mean without denominator)."""

    partition: str
    steps: list[int]
    values: dict[str, list[float]]

    def has(self, metric: str) -> bool:
        return metric in self.values

    def series(self, metric: str, *, absent: float = math.nan) -> list[float]:
        """The metric at every step; `absent` where it has no row (0.0 suits counters)."""
        column = self.values.get(metric)
        if column is None:
            return [absent] * len(self.steps)
        return [absent if math.isnan(v) else v for v in column]

    def names(self, prefix: str) -> list[str]:
        """The metrics named `prefix<something>`, sorted: reasons are open-ended, never a fixed list."""
        return sorted(
            name for name in self.values if name.startswith(prefix) and len(name) > len(prefix)
        )

    def last(self, metric: str) -> float:
        """The metric at the latest step that has it (NaN if none)."""
        for value in reversed(self.values.get(metric, [])):
            if not math.isnan(value):
                return value
        return math.nan


@dataclass
class ReportData:
    run: str
    tables: dict[
        str, StepTable
    ]  # partition -> its steps, in PARTITIONS order, only those with rows
    stepless: dict[
        str, dict[str, float]
    ]  # partition -> metrics of sessions recorded without a step
    failures: list[dict[str, Any]]
    positions: dict[str, int]  # projected, log_end, run_events, run_last (store.report_positions)
    generated_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def empty(self) -> bool:
        """No projected metric of the run at all (nothing projected yet)."""
        return not self.tables and not self.stepless

    @property
    def behind(self) -> int:
        """Events of the log the projector had not reached when the report was read."""
        return max(0, self.positions["log_end"] - self.positions["projected"])


def step_tables(
    rows: Iterable[tuple[str, int | None, str, float]],
) -> tuple[dict[str, StepTable], dict[str, dict[str, float]]]:
    """(partition, step, metric, value) rows → a `StepTable` per partition, plus the step-less rows."""
    by_partition: dict[str, dict[int, dict[str, float]]] = {}
    stepless: dict[str, dict[str, float]] = {}
    for partition, step, metric, value in rows:
        if step is None:
            stepless.setdefault(partition, {})[metric] = value
        else:
            by_partition.setdefault(partition, {}).setdefault(int(step), {})[metric] = value
    order = [p for p in PARTITIONS if p in by_partition] + sorted(
        set(by_partition) - set(PARTITIONS)
    )
    tables = {}
    for partition in order:
        per_step = by_partition[partition]
        steps = sorted(per_step)
        names = sorted({name for metrics in per_step.values() for name in metrics})
        values = {name: [per_step[s].get(name, math.nan) for s in steps] for name in names}
        tables[partition] = StepTable(partition, steps, values)
    return tables, stepless


async def resolve_run(engine: AsyncEngine, requested: str | None) -> str:
    """The run to report: `requested`, or the most recent; a one-line error when there is none."""
    async with engine.connect() as conn:
        if requested is None:
            latest = await rm.latest_run(conn)
            if latest is None:
                raise NotFound(
                    "the database has no events yet, so there is nothing to report; record sessions "
                    "(or run `rollout-ledger demo`) first"
                )
            return latest
        if (await report_positions(conn, requested))["run_events"] == 0:
            known = await rm.recent_runs(conn)
            named = (
                ", ".join(repr(r) for r in known)
                if known
                else "none: the database has no events yet"
            )
            raise NotFound(
                f"run {requested!r} has no events in this database; its runs (most recent first): {named}"
            )
    return requested


async def gather(engine: AsyncEngine, run: str, *, failures: int = FAILURE_ROWS) -> ReportData:
    """Everything the page shows. The checkpoint is read first, so the page's "projected up to
    position P" is a floor: a projector running meanwhile can only have added to the figures."""
    async with engine.connect() as conn:
        positions = await report_positions(conn, run)
        wasted = [
            (part, step, f"wasted_tokens/{cause}/{reason}", float(tokens))
            for part, step, cause, reason, tokens in await rm.wasted_call_tokens(
                conn, run, default_min_valid=DEFAULT_MIN_VALID
            )
        ]
        tables, stepless = step_tables([*await report_step_metrics(conn, run), *wasted])
        latest = await report_failures(conn, run, limit=failures)
    return ReportData(run, tables, stepless, latest, positions)
