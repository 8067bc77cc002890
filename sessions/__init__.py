"""rollout-ledger: every rollout session a persisted, event-sourced state machine.

Public API::

    from sessions import Ledger, SandboxError, InvalidTransition, ConcurrencyError
"""

from sessions.errors import (
    ConcurrencyError,
    InvalidInput,
    InvalidTransition,
    RolloutFailure,
    SandboxError,
    SchemaError,
    StoreError,
    UnknownEventError,
)
from sessions.ledger import DEFAULT_RUN, Ledger
from sessions.placeholder import PlaceholderPolicy
from sessions.recorder import SessionHandle, SessionOutcome

__all__ = [
    "DEFAULT_RUN",
    "ConcurrencyError",
    "InvalidInput",
    "InvalidTransition",
    "Ledger",
    "PlaceholderPolicy",
    "RolloutFailure",
    "SandboxError",
    "SchemaError",
    "SessionHandle",
    "SessionOutcome",
    "StoreError",
    "UnknownEventError",
]
