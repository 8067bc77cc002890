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


class SchemaError(StoreError):
    """The database's schema revision is unknown to this version of the library."""
