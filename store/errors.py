"""Errors raised by the persistence layer."""


class StoreError(Exception):
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
