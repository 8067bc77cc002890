"""The ledger's facade: the async `Ledger`, its options, the attempts loop of `run_session`, and
the synchronous faces (`sessions.ledger.sync`).

It sits above every room it drives (projection, batches, queues, audit, runs) and below the
rooms that drive it (export, report, trackers, integrations, cli). Its names load on first use,
so importing one of its modules (`sessions.ledger.config`) starts no recorder or projector.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each name -> the module that defines it; loaded on first use.
_NAMES: dict[str, str] = {
    "DEFAULT_RUN": "sessions.ledger.config",
    "RECORDING_TIMEOUT": "sessions.ledger.ledger",
    "Ledger": "sessions.ledger.ledger",
    "Runner": "sessions.ledger.attempts",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'sessions.ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
