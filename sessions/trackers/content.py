"""What a tracker logs for one step, gathered once and shared by every tracker.

A step's content is its scalars -- exactly `Ledger.metrics_dict`: verl's names and numbers, and
every metric row of the ledger's under `ledger/<partition>/<data_source or all>/<metric>`, whatever
metrics exist (no list of names is kept here) -- and a small, deterministic sample of its failed
sessions, as rows of a table (`FAILED_COLUMNS`). Trackers only turn this into their own calls, so
TensorBoard and W&B always log the same numbers under the same names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sessions.report.text import visible
from store import failed_session_samples

if TYPE_CHECKING:
    from sessions.ledger import Ledger

__all__ = [
    "FAILED_COLUMNS",
    "FailedSession",
    "StepContent",
    "StepKey",
    "collect_step",
    "failed_sessions_markdown",
    "failed_table_key",
]

#: (run, partition, global_step): what a tracker logs at most once.
StepKey = tuple[str, str, "int | None"]

#: The failed-sessions table's columns, in order (`FailedSession.row()` gives one row).
FAILED_COLUMNS = (
    "session_id",
    "uid",
    "data_source",
    "reason",
    "error_type",
    "message",
    "trajectories",
    "prompt_len",
    "response_len",
    "seconds",
)


@dataclass(frozen=True, slots=True)
class FailedSession:
    """One failed session of the sample: why it failed, and how far it had got.

    `trajectories`: trajectories it had recorded (discarded when it failed; its batch row is the
    reward-0 placeholder); `prompt_len` / `response_len`: the last of them, 0 when it recorded
    none, None when that event's stored JSON is unreadable; `seconds`: from creation to failure.
    """

    session_id: str
    uid: str
    data_source: str | None
    reason: str
    error_type: str | None
    message: str | None
    trajectories: int
    prompt_len: int | None
    response_len: int | None
    seconds: float | None

    def row(self) -> list[Any]:
        return [getattr(self, name) for name in FAILED_COLUMNS]

    def shown_row(self) -> list[Any]:
        """`row()` with every text as the terminal, the report and TensorBoard show it
        (`visible`: controls and bidi overrides escaped), for a tracker that renders cells."""
        return [visible(value) if isinstance(value, str) else value for value in self.row()]

    @classmethod
    def from_store(cls, row: Mapping[str, Any]) -> FailedSession:
        """From a `store.failed_session_samples` row."""
        trajectories = row["trajectories"]
        last = trajectories[-1] if trajectories else {}
        created, ended = row["created_at"], row["terminal_at"]
        return cls(
            session_id=row["session_id"],
            uid=row["uid"],
            data_source=row["data_source"],
            reason=row["failure_reason"] or "",
            error_type=row["error_type"],
            message=row["message"],
            trajectories=len(trajectories),
            prompt_len=None if last is None else int(last.get("prompt_len", 0)),
            response_len=None if last is None else int(last.get("response_len", 0)),
            seconds=None if created is None or ended is None else (ended - created).total_seconds(),
        )


@dataclass(frozen=True, slots=True)
class StepContent:
    """Everything logged for one step; `failed_total` counts all its failed sessions, `failed`
    is the sample (the first `per_reason` of each reason, in the order they failed)."""

    run: str
    partition: str
    global_step: int | None
    scalars: Mapping[str, float]
    failed: Sequence[FailedSession]
    failed_total: int
    per_reason: int = 3

    @property
    def key(self) -> StepKey:
        return (self.run, self.partition, self.global_step)


def failed_table_key(partition: str) -> str:
    """The tracker key of a partition's failed-sessions table, beside the ledger's own figures."""
    return f"ledger/{partition}/failed_sessions"


async def collect_step(
    ledger: Ledger,
    partition: str,
    global_step: int | None,
    *,
    run: str | None = None,
    timeout: float | None = 60.0,
    per_reason: int = 3,
    max_failed: int = 20,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> StepContent:
    """The step's content once the step is settled (waiting and projecting as `Ledger.batch`):
    its scalars are `Ledger.metrics_dict`'s, built from the same settled rows `batch` gets
    (`sessions.projection.settled`), then the failed-session sample of the step."""
    scalars = await ledger.metrics_dict(
        partition,
        global_step,
        run=run,
        timeout=timeout,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
    )
    run = ledger.run if run is None else run
    async with ledger.engine.connect() as conn:
        rows = await failed_session_samples(
            conn, run, partition, global_step, per_reason=per_reason, limit=max_failed
        )
    total = scalars.get(f"ledger/{partition}/all/sessions/failed", 0.0)
    failed = tuple(FailedSession.from_store(r) for r in rows)
    return StepContent(run, partition, global_step, scalars, failed, int(total), per_reason)


# ------------------------------------------------------------------ the table as markdown
#: Characters escaped with a backslash in a cell: the table's separator, and what markdown would
#: otherwise read as emphasis, code or a link.
_ESCAPED = frozenset("\\|*_`[]")


def _cell(value: Any) -> str:
    """A value as one markdown cell: shown as the terminal and the HTML report show it
    (`sessions.report.text.visible`: every control character, C1 code, line end and bidi override
    written as an escape, so a row stays on one line and reads as stored), then escaped for
    markdown (the separator, emphasis, code, links) and for the HTML a renderer lets through."""
    if value is None:
        return ""
    text = visible(f"{value:.3f}" if isinstance(value, float) else str(value))
    out = []
    for char in text:
        if char in _ESCAPED:
            out.append("\\" + char)
        elif char == "&":
            out.append("&amp;")
        elif char == "<":
            out.append("&lt;")
        else:
            out.append(char)
    return "".join(out)


def failed_sessions_markdown(content: StepContent) -> str:
    """The failed-sessions sample as a markdown table (TensorBoard's text plugin renders it), with
    a line above saying how many of the step's failures it shows."""
    head = (
        f"{content.failed_total} failed session(s) in {content.partition} step {content.global_step} "
        f"(run {_cell(content.run)}); {len(content.failed)} shown (the first {content.per_reason} of each reason)"
    )
    lines = [
        head,
        "",
        "| " + " | ".join(FAILED_COLUMNS) + " |",
        "|" + " --- |" * len(FAILED_COLUMNS),
    ]
    lines += [
        "| " + " | ".join(_cell(value) for value in failed.row()) + " |"
        for failed in content.failed
    ]
    return "\n".join(lines)
