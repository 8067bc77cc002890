"""`rollout-ledger sql`'s query runner, re-exported from `store.console` where its SQL lives.

Kept so `from sessions.cli.sql import WriteRefused, run_query` goes on working.
"""

from store import console

QueryError = console.QueryError
WriteRefused = console.WriteRefused
has_separator = console.has_separator
QueryTimeout = console.QueryTimeout
DEFAULT_TIMEOUT_S = console.DEFAULT_TIMEOUT_S
run_query = console.run_query

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "QueryError",
    "QueryTimeout",
    "WriteRefused",
    "has_separator",
    "run_query",
]
