"""Metric counts per (run, partition, global_step, data_source), kept incrementally.

Stored counters are additive (sums and counts), so the projector can update them one event at a
time and replay reproduces them exactly; the means are derived from the counters each time a
scope changes. Definitions (DESIGN §7, issue "Projector"):

- `reward/mean`: mean over batch rows (succeeded rows and placeholders) of the row reward, i.e.
  of `rm_scores.sum(-1)`; failures count as zeros, cancelled sessions have no row. A succeeded
  session whose reward was never posted contributes 0.0 here and is counted in `reward/absent`.
- `reward/mean_success_only`: the same over succeeded rows only — the inflated figure.
- `reward/mean@n`: per uid the mean of its sessions' final rows, then the mean over uids (verl's
  `val-core/<data_source>/reward/mean@n`), failures as zeros; n is the group size.
- `coverage`: succeeded / (succeeded + failed): the share of sessions the success-only mean covers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "COVERAGE",
    "FAILED_BY_REASON",
    "GROUPS_FAILURE",
    "GROUPS_FINISHED",
    "GROUPS_TOTAL",
    "GROUPS_UNSETTLED",
    "MetricRow",
    "MetricTable",
    "PLACEHOLDERS",
    "RESPONSE_LENGTH_MAX",
    "RESPONSE_LENGTH_MEAN",
    "RESPONSE_LENGTH_SUM",
    "REWARD_ABSENT",
    "REWARD_MEAN",
    "REWARD_MEAN_AT",
    "REWARD_MEAN_SUCCESS",
    "REWARD_SUM",
    "REWARD_SUM_SUCCESS",
    "ROWS",
    "ROWS_SUCCEEDED",
    "SESSIONS_CANCELLED",
    "SESSIONS_FAILED",
    "SESSIONS_OPEN",
    "SESSIONS_SUCCEEDED",
    "SESSIONS_TOTAL",
    "Scope",
    "UIDS",
    "UID_MEAN_SUM",
    "ZERO_FILLED",
    "scopes",
    "summarise",
]

Scope = tuple[str, str, "int | None", "str | None"]  # run, partition, global_step, data_source

# Counters (additive). Metrics whose name has a variable suffix are formatted on use.
SESSIONS_TOTAL = "sessions/total"
SESSIONS_SUCCEEDED = "sessions/succeeded"
SESSIONS_FAILED = "sessions/failed"
SESSIONS_CANCELLED = "sessions/cancelled"
PLACEHOLDERS = "placeholders"
GROUPS_TOTAL = "groups/total"
GROUPS_FINISHED = "groups/finished"
GROUPS_FAILURE = "groups/failure"
REWARD_ABSENT = "reward/absent"
ROWS = "rows/total"
ROWS_SUCCEEDED = "rows/succeeded"
REWARD_SUM = "reward/sum"
REWARD_SUM_SUCCESS = "reward/sum_success_only"
RESPONSE_LENGTH_SUM = "response_length/sum"
RESPONSE_LENGTH_MAX = "response_length/max"
FAILED_BY_REASON = "failed/{reason}"
UID_MEAN_SUM = "reward/uid_mean_sum@{n}"
UIDS = "reward/uids@{n}"

# Derived.
GROUPS_UNSETTLED = "groups/unsettled"
SESSIONS_OPEN = "sessions/open"
REWARD_MEAN = "reward/mean"
REWARD_MEAN_SUCCESS = "reward/mean_success_only"
REWARD_MEAN_AT = "reward/mean@{n}"
RESPONSE_LENGTH_MEAN = "response_length/mean"
COVERAGE = "coverage"

#: Counts every scope reports, zero included (DESIGN §7 lists them per scope).
ZERO_FILLED = (
    SESSIONS_TOTAL, SESSIONS_SUCCEEDED, SESSIONS_FAILED, SESSIONS_CANCELLED, PLACEHOLDERS,
    GROUPS_TOTAL, GROUPS_FINISHED, GROUPS_FAILURE, REWARD_ABSENT,
)


def scopes(run: str, partition: str, global_step: int | None, data_source: str | None) -> list[Scope]:
    """The per-data-source scope and the all-data-sources scope (data_source None)."""
    if data_source is None:
        return [(run, partition, global_step, None)]
    return [(run, partition, global_step, data_source), (run, partition, global_step, None)]


@dataclass
class MetricTable:
    """Counters of one scope plus derived values; `dirty` marks scopes to write back."""

    values: dict[str, float] = field(default_factory=dict)
    dirty: bool = False

    def add(self, name: str, amount: float = 1.0) -> None:
        self.values[name] = self.values.get(name, 0.0) + amount
        self.dirty = True

    def maximum(self, name: str, value: float) -> None:
        if value > self.values.get(name, float("-inf")):
            self.values[name] = float(value)
        self.dirty = True

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def derive(self) -> None:
        """Recompute the derived metrics from the counters."""
        v = self.values
        for name in ZERO_FILLED:  # a count that is zero is reported as 0, not left out
            v.setdefault(name, 0.0)
        v[GROUPS_UNSETTLED] = self.get(GROUPS_TOTAL) - self.get(GROUPS_FINISHED) - self.get(GROUPS_FAILURE)
        v[SESSIONS_OPEN] = (
            self.get(SESSIONS_TOTAL) - self.get(SESSIONS_SUCCEEDED) - self.get(SESSIONS_FAILED) - self.get(SESSIONS_CANCELLED)
        )
        _ratio(v, REWARD_MEAN, self.get(REWARD_SUM), self.get(ROWS))
        _ratio(v, REWARD_MEAN_SUCCESS, self.get(REWARD_SUM_SUCCESS), self.get(ROWS_SUCCEEDED))
        _ratio(v, RESPONSE_LENGTH_MEAN, self.get(RESPONSE_LENGTH_SUM), self.get(ROWS_SUCCEEDED))
        _ratio(v, COVERAGE, self.get(SESSIONS_SUCCEEDED), self.get(SESSIONS_SUCCEEDED) + self.get(SESSIONS_FAILED))
        for name in [k for k in v if k.startswith("reward/uids@")]:
            n = name.split("@", 1)[1]
            _ratio(v, REWARD_MEAN_AT.format(n=n), self.get(UID_MEAN_SUM.format(n=n)), self.get(name))


def _ratio(values: dict[str, float], name: str, numerator: float, denominator: float) -> None:
    if denominator > 0:
        values[name] = numerator / denominator
    else:
        values.pop(name, None)


@dataclass(frozen=True, slots=True)
class MetricRow:
    run: str
    partition: str
    global_step: int | None
    data_source: str | None
    metric: str
    value: float

    def as_json(self) -> dict[str, object]:
        return {
            "run": self.run,
            "partition": self.partition,
            "global_step": self.global_step,
            "data_source": self.data_source,
            "metric": self.metric,
            "value": self.value,
        }


def summarise(rows: Iterable[MetricRow]) -> dict[Scope, dict[str, float]]:
    out: dict[Scope, dict[str, float]] = {}
    for row in rows:
        out.setdefault((row.run, row.partition, row.global_step, row.data_source), {})[row.metric] = row.value
    return out
