"""Persistence for rollout-ledger: engines, tables, the event store, read models and queues.

`store` never imports `sessions`: it stores envelopes and rows, it does not know what a
session is. The domain talks to it through `EventStore`, `NewEvent` and `StoredEvent`.
"""

from store import read_models
from store.engine import create_engine, is_postgres, is_sqlite, load_json, normalize_url
from store.errors import ConcurrencyError, SchemaError, StoreError
from store.event_store import EventStore, is_transient, retry_transient
from store.migrate import current_revision, head_revision, upgrade
from store.records import NewEvent, StoredEvent

__all__ = [
    "ConcurrencyError",
    "EventStore",
    "NewEvent",
    "SchemaError",
    "StoreError",
    "StoredEvent",
    "create_engine",
    "current_revision",
    "head_revision",
    "is_postgres",
    "is_sqlite",
    "is_transient",
    "load_json",
    "normalize_url",
    "read_models",
    "retry_transient",
    "upgrade",
]
