"""Persistence for rollout-ledger: engines, tables, the event store, read models and queues.

`store` never imports `sessions`: it stores envelopes and rows, it does not know what a
session is. This module is the whole of what `sessions` may use (tests/test_architecture.py
checks it): the names below, and a few modules used as namespaces because their functions
belong together (`read_models`, `queue_claims`, `driver`, `bulk_copy`, `bulk_read_models`,
`console`, `export_reads`, `retention`).
Everything that differs between SQLite and PostgreSQL is answered by `store.dialects`.
"""

from sqlalchemy.ext.asyncio import AsyncEngine

from store import backup, read_models, retention
from store.bulk import bulk_copy, bulk_read_models, driver
from store.engine import (
    create_engine,
    describe_database,
    local_database_file,
    normalize_url,
)
from store.errors import (
    AppendOutcomeUnknown,
    ConcurrencyError,
    DriverError,
    LedgerError,
    SchemaError,
    StoreError,
    StoreInputError,
    TargetNotEmpty,
)
from store.log.append_sql import GroupConflict
from store.log.event_store import EventStore
from store.log.futures import DeferredCancelFuture, deferred_cancel
from store.log.records import NewEvent, StoredEvent, encode_data
from store.queue import queue_claims
from store.read_models.projection_locks import follower_leadership, projection_page
from store.read_models.read_model_scan import READ_MODEL_KEYS, TableScan, scan
from store.reads import console, export_reads
from store.reads.report_reads import report_failures, report_positions, report_step_metrics
from store.reads.tracker_reads import failed_session_samples
from store.retry import OPEN_ATTEMPTS, is_transient, retry_transient
from store.schema.columns import ColumnSpec, column_spec
from store.schema.ledger_file import holds_ledger
from store.schema.migrate import check_schema, current_revision, head_revision, upgrade
from store.stored_json import StoredJSONError, load_json

__all__ = [
    "OPEN_ATTEMPTS",
    "READ_MODEL_KEYS",
    "AsyncEngine",
    "ColumnSpec",
    "ConcurrencyError",
    "DeferredCancelFuture",
    "AppendOutcomeUnknown",
    "DriverError",
    "EventStore",
    "GroupConflict",
    "LedgerError",
    "NewEvent",
    "SchemaError",
    "StoreError",
    "StoreInputError",
    "StoredEvent",
    "StoredJSONError",
    "TableScan",
    "TargetNotEmpty",
    "backup",
    "bulk_copy",
    "bulk_read_models",
    "check_schema",
    "column_spec",
    "console",
    "create_engine",
    "current_revision",
    "deferred_cancel",
    "driver",
    "encode_data",
    "export_reads",
    "failed_session_samples",
    "follower_leadership",
    "head_revision",
    "holds_ledger",
    "local_database_file",
    "describe_database",
    "is_transient",
    "load_json",
    "normalize_url",
    "projection_page",
    "queue_claims",
    "read_models",
    "report_failures",
    "report_positions",
    "report_step_metrics",
    "retention",
    "retry_transient",
    "scan",
    "upgrade",
]
