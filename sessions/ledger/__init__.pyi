# Generated from sessions/ledger/__init__.py by `python -m sessions.ledger.stubgen`: edit that, not this.
"""The ledger's facade: the async `Ledger`, its options, the attempts loop of `run_session`, and
the synchronous faces (`sessions.ledger.sync`).

It sits above every room it drives (projection, batches, queues, audit, runs) and below the
rooms that drive it (export, report, trackers, integrations, cli). Its names load on first use,
so importing one of its modules (`sessions.ledger.config`) starts no recorder or projector; their
types are in the generated `__init__.pyi` (`python -m sessions.ledger.stubgen`)."""

from sessions.ledger.attempts import Runner
from sessions.ledger.config import DEFAULT_RUN
from sessions.ledger.ledger import RECORDING_TIMEOUT, Ledger

__all__ = ["DEFAULT_RUN", "Ledger", "RECORDING_TIMEOUT", "Runner"]
