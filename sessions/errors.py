"""Errors a user of the ledger sees. Each message names what was wrong and what to do.

Every error a public call raises on purpose derives from `LedgerError`, and keeps the builtin its
meaning suggests as a second base (`StepNotSettled` is a `TimeoutError`, `InvalidArgument` a
`ValueError`), so `except LedgerError` catches them all and older `except TimeoutError` or
`except ValueError` clauses keep working. The kinds a caller tells apart:

- `InvalidInput`: the data a session command was given (recorded as `invalid_output` when a runner
  raises it); `InvalidArgument` (and its `TypeError` / `IndexError` forms): any other call's
  argument; `ConfigError`: an option given when something is built or opened.
- `StepNotSettled`: `Ledger.batch` / `metrics_dict` waited `timeout` seconds and the step still has
  open groups; `LedgerTimeout`: any other wait that ran out.
- `LedgerClosed`, `UsageError`: a call in a state or place it cannot run in.
- `NotFound`: a run or rows the database does not have (`BatchPruned`: a step whose payloads a
  prune dropped); `StepPrunedError`: a session created in a step a prune closed; `MissingDependency`: an optional extra is
  not installed; `DamagedData`: stored data this library cannot have written.

The lowest module of the domain: it imports nothing of `sessions`, so every other module may
raise its errors. `RolloutFailure`, which checks its reason against the vocabulary where it is
raised, is in `sessions.runner_failure`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from store import (
    AppendOutcomeUnknown,
    ConcurrencyError,
    LedgerError,
    SchemaError,
    StepPrunedError,
    StoreError,
)

__all__ = [
    "AppendOutcomeUnknown",
    "BatchPruned",
    "ConcurrencyError",
    "ConfigError",
    "DamagedData",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidInput",
    "InvalidTransition",
    "LedgerClosed",
    "LedgerError",
    "LedgerTimeout",
    "MissingDependency",
    "NotFound",
    "ProjectionError",
    "RowIndexError",
    "RunHalted",
    "SchemaError",
    "StepNotSettled",
    "StepPrunedError",
    "StoreError",
    "UnknownEventError",
    "UsageError",
]


class InvalidTransition(LedgerError):
    """A command that the session's current state does not allow; nothing was appended."""

    def __init__(
        self, session_id: str, state: str, command: str, allowed: list[str] | None = None
    ) -> None:
        hint = (
            f" (allowed in {state!r}: {', '.join(allowed)})"
            if allowed
            else " (the session is terminal)"
        )
        super().__init__(f"session {session_id!r} is {state!r}: cannot {command}{hint}")
        self.session_id = session_id
        self.state = state
        self.command = command


class InvalidInput(LedgerError, ValueError):
    """Bad input from the caller (token ids, masks, rewards, identifiers); nothing was written."""

    def __init__(self, session_id: str | None, field: str, problem: str) -> None:
        where = f"session {session_id!r}: " if session_id else ""
        super().__init__(f"{where}{field}: {problem}")
        self.session_id = session_id
        self.field = field


class InvalidArgument(LedgerError, ValueError):
    """An argument a call cannot take (a partition, a step range, a batch's shape, a width);
    nothing was done. `argument` names it when one argument is at fault.

    Not an `InvalidInput`: a runner that passes a bad argument to a helper fails its session as
    `runner_error`, not as `invalid_output` (that one is for what a session was told to record).
    """

    def __init__(self, message: str, *, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of a type the call does not take (a jagged batch where a padded one is needed,
    an object that is not a tracker, a runner that is not async)."""


class RowIndexError(InvalidArgument, IndexError):
    """A row index or mask that does not fit the batch (out of range, wrong length or dtype)."""


class ConfigError(InvalidArgument):
    """An option that cannot work, given when something is built or opened (`Ledger.open`'s
    keywords, the policies, a sink, a tracker, a command-line flag); nothing was opened or
    changed."""


class LedgerTimeout(LedgerError, TimeoutError):
    """A wait ran out (a `SyncLedger` call's `call_timeout`, a queue sink's `sink_timeout`); what
    was waited on is named, and was cancelled or rolled back."""


class StepNotSettled(LedgerTimeout):
    """`Ledger.batch` / `metrics_dict` waited `timeout` seconds and the step still has groups
    with open sessions or slots no session was created for (or no sessions at all). Fail or
    cancel the open sessions (or run `recover`), create the missing ones, or wait longer;
    nothing was read.

    `pending_uids` names some of the unsettled groups (at most ten), `pending` counts them,
    `groups` counts the step's groups (0: nothing was recorded for the step). For the named
    groups, `open_sessions` maps a uid to its sessions created and not ended, and
    `never_created` a uid to the session indices (slots below its `group_size`) no session was
    created for; a uid with neither is left out of each.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str,
        partition: str,
        global_step: int | None,
        timeout: float | None,
        pending: int = 0,
        groups: int = 0,
        pending_uids: Sequence[str] = (),
        open_sessions: Mapping[str, int] | None = None,
        never_created: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        super().__init__(message)
        self.run = run
        self.partition = partition
        self.global_step = global_step
        self.timeout = timeout
        self.pending = pending
        self.groups = groups
        self.pending_uids = tuple(pending_uids)
        self.open_sessions = dict(open_sessions or {})
        self.never_created = {uid: tuple(slots) for uid, slots in (never_created or {}).items()}


class RunHalted(LedgerError, RuntimeError):
    """The run's circuit breaker tripped (`sessions.runs.breaker`): its sessions kept failing of
    a cause that says a dependency is down, so no session of the run is created, and no step's
    batch or metrics handed to training, until the run is launched again. `run`, `rule` and
    `tripped_at` (the log position of the session end that tripped it) say where; the message
    says what failed, what to check and how to resume."""

    def __init__(self, run: str, rule: str, tripped_at: int, why: str) -> None:
        super().__init__(
            f"run {run!r} halted by its circuit breaker at log position {tripped_at}: {why}. "
            "Check the service behind those failures (`rollout-ledger history` shows a "
            "session's errors; the failure_breakdown view the counts), then resume the run "
            "with a new launch (restart the job: `Ledger.open(..., launch=...)` or "
            "$ROLLOUT_LEDGER_LAUNCH); `circuit_breaker=` in the ledger's settings sets the rule"
        )
        self.run, self.rule, self.tripped_at = run, rule, tripped_at


class UsageError(LedgerError, RuntimeError):
    """A call made where or when it cannot run (on another event loop, on the ledger's own loop
    thread where it would wait on itself, twice where once is all); nothing was done."""


class LedgerClosed(UsageError):
    """The ledger (or `SyncLedger`) was closed before or during the call; open another."""


class NotFound(LedgerError, LookupError):
    """What the call asked for is not in the database (a run, a step's rows); the message lists
    what there is."""


class BatchPruned(NotFound):
    """The step's token payloads were pruned (`rollout-ledger prune`, `sessions.runs.retention`):
    its batch cannot be built from this database. The message names the prune (its steps, when,
    its id); metrics and the audit still cover the step. Read it from the prune's Parquet archive
    if one was written, or ask for a step the retention kept."""

    def __init__(
        self,
        message: str,
        *,
        run: str,
        partition: str,
        global_step: int | None,
        prune_id: str,
        pruned_at: str,
        steps: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.run = run
        self.partition = partition
        self.global_step = global_step
        self.prune_id = prune_id
        self.pruned_at = pruned_at
        self.steps = tuple(steps)


class MissingDependency(LedgerError, ImportError):
    """An optional extra this call needs is not installed; the message names the pip command."""


class DamagedData(StoreError, ValueError):
    """Stored data this library cannot have written (a token payload whose size disagrees with
    its recorded lengths): the database was altered outside it. `rollout-ledger audit` says
    where."""


class UnknownEventError(StoreError):
    """The log holds an event type or schema version this library cannot read."""


class ProjectionError(LedgerError, RuntimeError):
    """The read models and the log disagree, so rows cannot be built from them (a queue row that
    points at a missing event: the database was altered outside the library). The projector
    itself never raises it for an event it cannot project: it quarantines that event (docs/design.md §7)."""
