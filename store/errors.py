"""Errors raised by the persistence layer, and the root every rollout-ledger error derives from.

The root lives here, in the lowest layer, because `store` never imports `sessions`; `sessions`
re-exports it as `sessions.LedgerError`.
"""


class LedgerError(Exception):
    """The root of every error rollout-ledger raises: `except LedgerError` catches them all.

    Subclasses keep the builtin base their meaning suggests too (`InvalidInput` is a `ValueError`,
    `TransferQueueTimeout` a `TimeoutError`), so existing `except` clauses keep working.
    """


class StoreError(LedgerError):
    """Base class for persistence errors."""


class ConcurrencyError(StoreError):
    """An append's expected version did not match the stream: nothing of it was written."""

    def __init__(self, session_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"session {session_id!r}: expected version {expected} but the log is at {actual}; "
            "another writer appended to this session — reload it and retry the command"
        )
        self.session_id = session_id
        self.expected = expected
        self.actual = actual


class StepPrunedError(StoreError, ValueError):
    """A session created in a step a prune already closed (docs/design.md §14): its payloads are
    gone and its queue rows dropped, so nothing new may enter it. Nothing was written."""

    def __init__(
        self,
        session_id: str,
        run: str,
        partition: str,
        global_step: int,
        prune_id: str,
        position: int,
    ) -> None:
        super().__init__(
            f"session {session_id!r}: run {run!r} {partition} step {global_step} was pruned by prune "
            f"{prune_id} (log position {position}); a pruned step is closed — record this session in "
            "a step that is not pruned"
        )
        self.session_id = session_id
        self.run = run
        self.partition = partition
        self.global_step = global_step
        self.prune_id = prune_id
        self.position = position


class SchemaError(StoreError):
    """The database's schema revision is unknown to this version of the library."""


class StoreInputError(StoreError, ValueError):
    """A store call given an argument it cannot use (a database URL of another kind, a queue row
    id that is not an integer, a stream's events out of order); nothing was done. A `ValueError`
    too, so callers that checked for one keep working."""


class TargetNotEmpty(StoreError, ValueError):
    """A replay's target already holds read models (a projector checkpoint): a replay rebuilds
    them into empty tables only."""


class DriverError(StoreError):
    """A database or driver fault during a store call (a lost connection, a lock not had in time,
    a full disk, a damaged file, a value the driver refused). The message says what failed and what
    to do; the driver's own error is chained as `__cause__`, where `store.is_transient` and the
    CLI's one-line printer read it."""

    def __init__(self, message: str, *, what: str = "") -> None:
        super().__init__(message)
        #: What the store was doing (`"append to session 's1'"`, `"upgrade"`, …).
        self.what = what


class DatabaseUnreachableError(DriverError, ConnectionError):
    """Opening a database found no server to talk to (the connection refused, reset or its host
    unknown), after the open's retries: the message names the server and what to check."""


class AppendOutcomeUnknown(DriverError):
    """An append whose commit may or may not have landed: the connection dropped while it ran,
    and the database could not be asked afterwards which of its events it holds. Nothing is
    applied to the session's handle. Retrying the same command on that handle is safe: it sends
    the same event ids again, and the store recognises them if the first commit landed (no
    duplicate); a different command first reads back which it was."""

    def __init__(
        self, message: str, *, what: str = "", session_id: str, event_ids: tuple[str, ...]
    ) -> None:
        super().__init__(message, what=what)
        self.session_id = session_id
        self.event_ids = event_ids


class StoreInvariantError(StoreError, RuntimeError):
    """The store broke one of its own invariants: a bug in rollout-ledger, not the caller's; the
    message says what did not hold. Report it with the traceback."""


class UnknownColumn(StoreError, KeyError):
    """A column name (`table.column`) the schema does not declare."""
