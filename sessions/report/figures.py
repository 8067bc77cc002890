"""What each figure of the report draws, as plain series (no matplotlib here).

A figure is a grid of panels (a row per topic, a column per partition); a panel holds named
series already downsampled (`downsample`). Keeping the series apart from the drawing lets a test
check what a figure shows -- e.g. that the shaded gap between `reward/mean` and
`reward/mean_success_only` is there -- without reading pixels.

Metric names with an open suffix (`failed/<reason>`, `excluded/<reason>`, `failed_origin/<o>`,
`retries/<reason>`) are found in the data, never listed here: a new reason shows up by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from sessions.report.data import StepTable
from sessions.report.downsample import MAX_POINTS, Buckets, bucket_steps, reduce

__all__ = ["FigureSpec", "Panel", "plan_figures"]

#: Series whose per-bucket reduction is the maximum, not the mean (they are maxima themselves).
_MAXIMA = ("response_length/max",)


@dataclass(frozen=True)
class _Series:
    label: str  # the metric name, as stored
    x: list[float]
    y: list[float]
    style: str = "line"  # line | dashed | stack (stacked with the panel's other stack series)


@dataclass
class Panel:
    title: str
    series: list[_Series] = field(default_factory=list)
    ylabel: str = ""
    gap: tuple[str, str] | None = None  # (lower, upper) labels: the area between them is shaded
    note: str | None = None  # drawn across a panel with nothing to show
    ylim: tuple[float, float] | None = None
    #: The y axis starts at 0 (counts and lengths): on an axis cut to the data's range a small
    #: dip fills the panel and reads as a crash. Rewards, which may be negative, are not.
    zero_based: bool = False

    def get(self, label: str) -> _Series | None:
        return next((s for s in self.series if s.label == label), None)


@dataclass
class FigureSpec:
    name: str  # the PNG's file stem: fixed names only, never user text
    title: str
    caption: str
    rows: list[list[Panel]]
    steps_per_point: int = 1  # the largest bucket size of its panels (1: every step drawn)

    def panel(self, title: str, row: int = 0) -> Panel:
        return next(p for p in self.rows[row] if p.title == title)

    def points(self) -> int:
        """The most points any one series of the figure draws."""
        return max((len(s.x) for r in self.rows for p in r for s in p.series), default=0)


class _Columns:
    """One partition's table with its buckets: series by metric name, reduced per bucket."""

    def __init__(self, table: StepTable, max_points: int) -> None:
        self.table = table
        self.buckets: Buckets = bucket_steps(table.steps, max_points)

    def series(self, metric: str, style: str = "line", *, counter: bool = False) -> _Series:
        """Counters are 0 at a step without their row; means are absent (a gap) there."""
        raw = self.table.series(metric, absent=0.0 if counter else math.nan)
        return self.reduced(metric, raw, style, "max" if metric in _MAXIMA else "mean")

    def reduced(
        self, label: str, raw: list[float], style: str = "line", how: str = "mean"
    ) -> _Series:
        """Per-step values (one per step of the table) as a series, reduced per bucket."""
        return _Series(label, list(self.buckets.x), reduce(raw, self.buckets, how), style)

    def title(self) -> str:
        size = self.buckets.size
        return self.table.partition + (f" ({size} steps per point)" if size > 1 else "")


def _nonzero(columns: _Columns, metric: str) -> bool:
    return any(v for v in columns.table.series(metric, absent=0.0))


def _differs(table: StepTable, metric: str, other: str) -> bool:
    """Whether `metric` is there and departs from `other` at some step (else drawing it adds nothing)."""
    if not table.has(metric):
        return False
    return any(
        not math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
        for a, b in zip(table.series(metric), table.series(other))
        if not (math.isnan(a) and math.isnan(b))
    )


def _reward(c: _Columns) -> Panel:
    series = [c.series("reward/mean"), c.series("reward/mean_success_only")]
    if _differs(
        c.table, "reward/mean_default_rule", "reward/mean"
    ):  # equal unless failures were excluded
        series.append(c.series("reward/mean_default_rule", "dashed"))
    return Panel(
        c.title(), series, "reward per step", gap=("reward/mean", "reward/mean_success_only")
    )


def _difference(c: _Columns, label: str, minuend: str, subtrahend: str) -> _Series:
    """`minuend - subtrahend` per step (NaN where either is absent), reduced per bucket."""
    a, b = c.table.series(minuend), c.table.series(subtrahend)
    return c.reduced(label, [x - y for x, y in zip(a, b)])


def _ratio_series(c: _Columns, label: str, numerator: str, denominator: str) -> _Series:
    """`numerator / denominator` per step of counters (NaN without a denominator)."""
    top = c.table.series(numerator, absent=0.0)
    bottom = c.table.series(denominator, absent=0.0)
    return c.reduced(label, [x / y if y else math.nan for x, y in zip(top, bottom)])


def _cost(c: _Columns) -> Panel:
    return Panel(
        c.title(),
        [
            _difference(c, "reward gap", "reward/mean_success_only", "reward/mean"),
            _ratio_series(c, "masked share", "placeholders", "rows/total"),
        ],
        "per step",  # not zero-based: a partial row's reward can make the gap negative
    )


def _outcomes(c: _Columns) -> Panel:
    names = ["sessions/succeeded", "sessions/failed", "sessions/cancelled"]
    names += [n for n in ("sessions/open",) if _nonzero(c, n)]
    series = [c.series(n, "stack", counter=True) for n in names]
    if c.table.has("sessions/excluded"):
        series.append(c.series("sessions/excluded", "dashed", counter=True))
    if _nonzero(c, "sessions/superseded"):  # an earlier launch's, in a step a resume re-ran
        series.append(c.series("sessions/superseded", "dashed", counter=True))
    return Panel(c.title(), series, "sessions per step", zero_based=True)


def _stack(
    prefix: str, empty: str, extra: tuple[str, ...] = (), ylabel: str = "sessions per step"
) -> Callable[[_Columns], Panel]:
    """A panel stacking every `prefix<name>` counter the data holds (plus `extra` as lines)."""

    def build(c: _Columns) -> Panel:
        series = [c.series(n, "stack", counter=True) for n in c.table.names(prefix)]
        series += [c.series(n, "line", counter=True) for n in extra if c.table.has(n)]
        return Panel(
            c.title(),
            series,
            ylabel,
            note=None if series else empty,
            zero_based=True,
        )

    return build


def _coverage(c: _Columns) -> Panel:
    return Panel(
        c.title(), [c.series("coverage")], "succeeded / (succeeded + failed)", ylim=(0.0, 1.05)
    )


def _attempts(c: _Columns) -> Panel:
    series = [
        c.series(n, counter=True) for n in ("attempts/total", "sessions/total") if c.table.has(n)
    ]
    return Panel(c.title(), series, "per step", zero_based=True)


def _groups(c: _Columns) -> Panel:
    names = ["groups/finished", "groups/failure"] + [
        n for n in ("groups/unsettled",) if _nonzero(c, n)
    ]
    series = [c.series(n, "stack", counter=True) for n in names]
    if c.table.has("groups/below_min_valid"):
        series.append(c.series("groups/below_min_valid", "dashed", counter=True))
    return Panel(c.title(), series, "groups per step", zero_based=True)


def _lengths(c: _Columns) -> Panel:
    series = [
        c.series(n) for n in ("response_length/mean", "response_length/max") if c.table.has(n)
    ]
    return Panel(
        c.title(),
        series,
        "tokens",
        note=None if series else "no response recorded",
        zero_based=True,
    )


def _any(columns: list[_Columns], test: Callable[[StepTable], bool]) -> bool:
    return any(test(c.table) for c in columns)


def plan_figures(tables: dict[str, StepTable], *, max_points: int = MAX_POINTS) -> list[FigureSpec]:
    """Every figure of the report, in page order, from the partitions' step tables."""
    columns = [_Columns(t, max_points) for t in tables.values()]
    if not columns:
        return []
    size = max(c.buckets.size for c in columns)

    def figure(
        name: str, title: str, caption: str, *rows: Callable[[_Columns], Panel]
    ) -> FigureSpec:
        return FigureSpec(
            name, title, caption, [[build(c) for c in columns] for build in rows], size
        )

    out = [
        figure(
            "reward",
            "Reward: honest vs. success-only",
            "reward/mean counts every failed session as a reward-0 placeholder row; reward/mean_success_only "
            "averages the succeeded rows only, which is what dropping failures reports. The shaded band between "
            "them is the inflation. reward/mean_default_rule (every row, failures as zeros) is drawn dashed "
            "only where a metric policy excluded failures, which is the only case where it differs from reward/mean.",
            _reward,
        ),
        figure(
            "sessions",
            "Sessions by outcome",
            "Sessions created per step, stacked by how they ended (open: not ended when the report was read).",
            _outcomes,
        ),
    ]
    failure_rows = [_stack("failed/", "no failures recorded")]
    if _any(columns, lambda t: bool(t.names("failed_origin/"))):
        failure_rows.append(_stack("failed_origin/", "no failure origin recorded"))
    out.append(
        figure(
            "failures",
            "Failures by reason",
            "Failed sessions per step, stacked by failure reason (the failed/<reason> counters)"
            + ("; below, by origin (failed_origin/<origin>)." if len(failure_rows) > 1 else "."),
            *failure_rows,
        )
    )
    if _any(columns, lambda t: bool(t.names("excluded/")) or t.has("sessions/excluded")):
        out.append(
            figure(
                "exclusions",
                "Exclusions by reason",
                "Sessions excluded per step, stacked by reason (excluded/<reason>); "
                "sessions/excluded as a line.",
                _stack("excluded/", "no exclusions recorded", ("sessions/excluded",)),
            )
        )
    out.append(
        figure(
            "coverage",
            "Coverage",
            "The share of ended sessions (succeeded or failed) that the success-only mean covers; "
            "1.0 means no failures.",
            _coverage,
        )
    )
    retried = any(
        _nonzero(c, n) for c in columns for n in ["sessions/retried", *c.table.names("retries/")]
    )
    if retried:
        out.append(
            figure(
                "retries",
                "Attempts and retries",
                "Above: attempts per step beside sessions per step. Below: retries per step, stacked by "
                "reason (retries/<reason>), and sessions that were retried (sessions/retried).",
                _attempts,
                _stack("retries/", "no retries recorded", ("sessions/retried",)),
            )
        )
    else:
        empty = Panel("all partitions", note="no retries recorded")
        out.append(
            FigureSpec(
                "retries",
                "Attempts and retries",
                "No session of this run was retried: no retries/<reason> or sessions/retried count "
                "above 0 at any step.",
                [[empty]],
                size,
            )
        )
    out.append(
        figure(
            "cost",
            "What failures cost",
            "reward gap: reward/mean_success_only minus reward/mean, what dropping failed sessions would "
            "have added to the headline (the reward figure's shaded band, over steps); masked share: "
            "placeholder rows over all rows, the share of the batch no gradient reads.",
            _cost,
        )
    )
    if _any(columns, lambda t: bool(t.names("wasted_tokens/"))):
        out.append(
            figure(
                "wasted_tokens",
                "Wasted work: tokens that trained nothing",
                "Model-call response tokens per step that no gradient used, stacked by cause and reason "
                "(wasted_tokens/<cause>/<reason>): of attempts retried or failed, and of successful "
                "sessions in groups below min_valid (no_signal). Only runs that record model calls have "
                "them; the reward figure's shaded band is the other cost, in reward.",
                _stack("wasted_tokens/", "no wasted tokens", ylabel="tokens per step"),
            )
        )
    out.append(
        figure(
            "groups",
            "Group outcomes",
            "Settled groups per step: finished (at least one session succeeded) or failure (none did); "
            "unsettled groups are still waiting for sessions.",
            _groups,
        )
    )
    out.append(
        figure(
            "response_length",
            "Response lengths",
            "Response tokens of succeeded rows per step: mean and maximum.",
            _lengths,
        )
    )
    return out
