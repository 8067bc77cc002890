"""The ledger's facade: the async `Ledger`, its options, the attempts loop of `run_session`, and
the synchronous faces (`sessions.ledger.sync`).

It sits above every room it drives (projection, batches, queues, audit, runs) and below the
rooms that drive it (export, report, trackers, integrations, cli). Its names load on first use,
so importing one of its modules (`sessions.ledger.config`) starts no recorder or projector; their
types are in the generated `__init__.pyi` (`python -m sessions.ledger.stubgen`).
"""

from __future__ import annotations

from sessions.lazy import lazy_names

#: Each name -> the module that defines it; loaded on first use.
_NAMES: dict[str, str] = {
    "DEFAULT_RUN": "sessions.ledger.config",
    "RECORDING_TIMEOUT": "sessions.ledger.ledger",
    "Ledger": "sessions.ledger.ledger",
    "Runner": "sessions.ledger.attempts",
}

__getattr__, __dir__, __all__ = lazy_names(globals(), _NAMES)
