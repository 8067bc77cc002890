"""The `rollout-ledger` command line."""

from sessions.cli.main import main

__all__ = ["main"]
