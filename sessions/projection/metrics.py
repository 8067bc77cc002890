"""Metric counts per (run, partition, global_step, data_source), kept incrementally.

Stored counters are additive (sums and counts), so the projector can update them one event at a
time and replay reproduces them exactly; the means are derived from the counters each time a
scope changes. Definitions (docs/design.md §7, issue "Projector"):

- `reward/mean`: mean over batch rows (succeeded rows and placeholders) of the row reward, i.e.
  of `rm_scores.sum(-1)`; failures count as zeros, cancelled sessions have no row. A succeeded
  session whose reward was never posted contributes 0.0 here and is counted in `reward/absent`.
- `reward/mean_success_only`: the same over succeeded rows only — the inflated figure.
- `reward/mean@k`: exactly verl's `val-core/<data_source>/reward/mean@k` (`process_validation_metrics`)
  on the same batch: a settled group (uid) with k batch rows has the mean of its rows' rewards
  (failures as zeros; with trajectory selection `all` a session gives several rows); the figure is
  the mean over the groups with k rows. k is the row count, not the group size: a group of 4 that
  lost a session to cancellation or a drop policy files under `mean@3`, as in verl, whose headline
  is the largest k. Counted when the group settles (verl only ever sees settled batches).
- `reward/mean_per_uid`: the ledger's own complete figure: the same per-group means, averaged over
  every settled group with at least one row, whatever its row count.
- `reward/uids_excluded`: settled groups outside the headline `reward/mean@N` (N the scope's largest
  k): those with fewer rows, or none at all.
- `coverage`: succeeded / (succeeded + failed): the share of sessions the success-only mean covers.

Failure semantics (`docs/failures.md`), each decided when the session failed and read from its
events: with a metric policy of `exclude` a failed session's rows leave `reward/mean` and the
groups' means behind `reward/mean@k` (`rows/excluded`, `excluded/<reason>`, `sessions/excluded`
count them), while `reward/mean_default_rule` — every row, failures as zeros — is always
reported beside it; the two are equal when nothing is excluded. `rows/partial` counts the rows a
`keep_partial` failure sent with its own reward (they are not in the success-only figures).
A step re-run by a later launch of the run (`sessions.runs.launches`) counts that launch's
sessions only: its scopes start again from zero when the later launch's first session arrives,
keeping `sessions/superseded` (the earlier launches' sessions) and `launch` (whose sessions count).
`attempts/total` counts attempts started, `sessions/retried` the sessions with a superseded
attempt and `retries/<reason>` the superseded attempts by reason. `failed_origin/<origin>` counts
failures by origin. `groups/below_min_valid` counts settled train groups with fewer valid
(non-placeholder) rows than the run's `min_valid`: groups GRPO takes no signal from.

Sums of finite rewards never become NaN (a sum past the float range is stored as +-infinity, and
so is a mean derived from it); a group's mean, always in range, is computed so that it stays
finite (`group_mean`), so the counters summing group means only ever add finite values.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTEMPTS",
    "COVERAGE",
    "RESPONSE_LENGTH_MEAN",
    "REWARD_MEAN_AT",
    "SESSIONS_OPEN",
    "EXCLUDED_BY_REASON",
    "FAILED_BY_ORIGIN",
    "FAILED_BY_REASON",
    "GROUPS_BELOW_MIN_VALID",
    "REWARD_MEAN_DEFAULT_RULE",
    "REWARD_SUM_EXCLUDED",
    "RETRIES_BY_REASON",
    "ROWS_EXCLUDED",
    "ROWS_PARTIAL",
    "SESSIONS_EXCLUDED",
    "SESSIONS_RETRIED",
    "SESSIONS_SUPERSEDED",
    "LAUNCH",
    "GROUPS_FAILURE",
    "GROUPS_FINISHED",
    "GROUPS_TOTAL",
    "GROUPS_UNSETTLED",
    "MetricRow",
    "MetricTable",
    "PLACEHOLDERS",
    "RESPONSE_LENGTH_MAX",
    "RESPONSE_LENGTH_SUM",
    "REWARD_ABSENT",
    "REWARD_MEAN",
    "REWARD_MEAN_SUCCESS",
    "REWARD_SUM",
    "REWARD_SUM_SUCCESS",
    "ROWS",
    "ROWS_SUCCEEDED",
    "SESSIONS_CANCELLED",
    "SESSIONS_FAILED",
    "SESSIONS_SUCCEEDED",
    "SESSIONS_TOTAL",
    "Scope",
    "REWARD_MEAN_PER_UID",
    "UIDS",
    "UIDS_ALL",
    "UIDS_EXCLUDED",
    "UID_MEAN_SUM",
    "UID_MEAN_SUM_ALL",
    "group_mean",
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
FAILED_BY_ORIGIN = "failed_origin/{origin}"
ATTEMPTS = "attempts/total"
SESSIONS_RETRIED = "sessions/retried"
RETRIES_BY_REASON = "retries/{reason}"
#: Sessions whose retry a spent budget refused (`RetryPolicy.group_budget` / `step_budget`).
REFUSED_BY_BUDGET = "refused/{budget}"
EXCLUDED_BY_REASON = "excluded/{reason}"
SESSIONS_EXCLUDED = "sessions/excluded"
ROWS_EXCLUDED = "rows/excluded"
REWARD_SUM_EXCLUDED = "reward/sum_excluded"
ROWS_PARTIAL = "rows/partial"
GROUPS_BELOW_MIN_VALID = "groups/below_min_valid"
#: Sessions of earlier launches in a step a later launch re-ran: out of every other figure.
SESSIONS_SUPERSEDED = "sessions/superseded"
#: Not a counter: the number of the run's launch whose sessions the step's figures count, in the
#: step's all-sources scope (set only once a launch is recorded; `sessions.runs.launches`).
LAUNCH = "launch"
#: Per row count k: the sum of the settled groups' means and how many groups have k rows.
UID_MEAN_SUM = "reward/uid_mean_sum@{n}"
UIDS = "reward/uids@{n}"
#: The same over every settled group with a row, whatever its row count.
UID_MEAN_SUM_ALL = "reward/uid_mean_sum"
UIDS_ALL = "reward/uids"

# Derived.
GROUPS_UNSETTLED = "groups/unsettled"
SESSIONS_OPEN = "sessions/open"
REWARD_MEAN = "reward/mean"
REWARD_MEAN_DEFAULT_RULE = "reward/mean_default_rule"
REWARD_MEAN_SUCCESS = "reward/mean_success_only"
REWARD_MEAN_AT = "reward/mean@{n}"
REWARD_MEAN_PER_UID = "reward/mean_per_uid"
UIDS_EXCLUDED = "reward/uids_excluded"
RESPONSE_LENGTH_MEAN = "response_length/mean"
COVERAGE = "coverage"

#: Counts every scope reports, zero included (docs/design.md §7 lists them per scope).
_ZERO_FILLED = (
    SESSIONS_TOTAL,
    SESSIONS_SUCCEEDED,
    SESSIONS_FAILED,
    SESSIONS_CANCELLED,
    PLACEHOLDERS,
    GROUPS_TOTAL,
    GROUPS_FINISHED,
    GROUPS_FAILURE,
    REWARD_ABSENT,
)


def scopes(
    run: str, partition: str, global_step: int | None, data_source: str | None
) -> list[Scope]:
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
        for name in _ZERO_FILLED:  # a count that is zero is reported as 0, not left out
            v.setdefault(name, 0.0)
        v[GROUPS_UNSETTLED] = (
            self.get(GROUPS_TOTAL) - self.get(GROUPS_FINISHED) - self.get(GROUPS_FAILURE)
        )
        v[SESSIONS_OPEN] = (
            self.get(SESSIONS_TOTAL)
            - self.get(SESSIONS_SUCCEEDED)
            - self.get(SESSIONS_FAILED)
            - self.get(SESSIONS_CANCELLED)
        )
        _ratio(
            v,
            REWARD_MEAN,
            self.get(REWARD_SUM) - self.get(REWARD_SUM_EXCLUDED),
            self.get(ROWS) - self.get(ROWS_EXCLUDED),
        )
        _ratio(v, REWARD_MEAN_DEFAULT_RULE, self.get(REWARD_SUM), self.get(ROWS))
        _ratio(v, REWARD_MEAN_SUCCESS, self.get(REWARD_SUM_SUCCESS), self.get(ROWS_SUCCEEDED))
        _ratio(v, RESPONSE_LENGTH_MEAN, self.get(RESPONSE_LENGTH_SUM), self.get(ROWS_SUCCEEDED))
        _ratio(
            v,
            COVERAGE,
            self.get(SESSIONS_SUCCEEDED),
            self.get(SESSIONS_SUCCEEDED) + self.get(SESSIONS_FAILED),
        )
        _ratio(v, REWARD_MEAN_PER_UID, self.get(UID_MEAN_SUM_ALL), self.get(UIDS_ALL))
        top = 0
        for name in [k for k in v if k.startswith(_UIDS_AT)]:
            n = name[len(_UIDS_AT) :]
            top = max(top, int(n))
            _ratio(
                v, REWARD_MEAN_AT.format(n=n), self.get(UID_MEAN_SUM.format(n=n)), self.get(name)
            )
        # The name is fixed (no "@N"): N grows as groups settle, and a stored row is never deleted.
        settled = self.get(GROUPS_FINISHED) + self.get(GROUPS_FAILURE)
        v[UIDS_EXCLUDED] = settled - (self.get(UIDS.format(n=top)) if top else 0.0)


_UIDS_AT = UIDS.format(n="")
_FLOAT_MAX = sys.float_info.max


def group_mean(reward_sum: float, rows: int) -> float:
    """A group's mean row reward from its sum: finite for finite rewards. When the sum left the
    float range (it is then +-inf) the mean, which cannot, saturates at +-float max: the sum no
    longer says where in range it is, and an infinite addend could meet its opposite (NaN)."""
    mean = reward_sum / rows
    return mean if math.isfinite(mean) else math.copysign(_FLOAT_MAX, mean)


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

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> MetricRow:
        """From a `metric_counts` row as the store reads it (`store.read_models.metric_rows`)."""
        return cls(
            row["run"],
            row["partition"],
            row["global_step"],
            row["data_source"],
            row["metric"],
            row["value"],
        )

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
        out.setdefault((row.run, row.partition, row.global_step, row.data_source), {})[
            row.metric
        ] = row.value
    return out
