"""`rollout-ledger sql`'s query runner, re-exported from `store.console` where its SQL lives.

Kept so `from sessions.cli.sql import WriteRefused, run_query` goes on working.
"""

from store.console import QueryError, WriteRefused, has_separator, run_query

__all__ = ["QueryError", "WriteRefused", "has_separator", "run_query"]
