"""Persistence for rollout-ledger: engines, tables, the event store, read models and queues.

`store` never imports `sessions`: it stores envelopes and rows, it does not know what a
session is. This module is the whole of what `sessions` may use (tests/test_architecture.py
checks it): the names below, and a few modules used as namespaces because their functions
belong together (`read_models`, `queue_claims`, `driver`, `bulk_copy`, `bulk_read_models`,
`console`, `export_reads`, `retention`, `otel_follower`).
Everything that differs between SQLite and PostgreSQL is answered by `store.dialects`, what a
driver's error means too (`raised_by_driver`, `describe_driver_error`, `driver_install_hint`,
`is_transient`): `sessions` names no driver.

Each name loads its module on first use (PEP 562), so a command that needs none of SQLAlchemy,
Alembic or the drivers (the CLI's `--help`, an argument error) does not pay their import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what an editor and a type checker see; nothing is imported at run time
    from sqlalchemy.ext.asyncio import AsyncEngine

    from store import backup, otel_follower, read_models, retention
    from store.bulk import bulk_copy, bulk_read_models, driver
    from store.dialects import driver_install_hint, raised_by_driver
    from store.engine import (
        create_engine,
        describe_database,
        describe_driver_error,
        local_database_file,
        normalize_url,
    )
    from store.errors import (
        AppendOutcomeUnknown,
        ConcurrencyError,
        DriverError,
        LedgerError,
        SchemaError,
        StepPrunedError,
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
    from store.schema.migrate import current_revision, upgrade
    from store.schema.state import check_schema, head_revision
    from store.stored_json import StoredJSONError, load_json

#: Each exported name -> (the module that defines it, its attribute there; None: the module).
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "AsyncEngine": ("sqlalchemy.ext.asyncio", "AsyncEngine"),
    "backup": ("store.backup", None),
    "otel_follower": ("store.otel_follower", None),
    "read_models": ("store.read_models", None),
    "retention": ("store.retention", None),
    "bulk_copy": ("store.bulk.bulk_copy", None),
    "bulk_read_models": ("store.bulk.bulk_read_models", None),
    "driver": ("store.bulk.driver", None),
    "driver_install_hint": ("store.dialects", "driver_install_hint"),
    "raised_by_driver": ("store.dialects", "raised_by_driver"),
    "create_engine": ("store.engine", "create_engine"),
    "describe_database": ("store.engine", "describe_database"),
    "describe_driver_error": ("store.engine", "describe_driver_error"),
    "local_database_file": ("store.engine", "local_database_file"),
    "normalize_url": ("store.engine", "normalize_url"),
    "AppendOutcomeUnknown": ("store.errors", "AppendOutcomeUnknown"),
    "ConcurrencyError": ("store.errors", "ConcurrencyError"),
    "DriverError": ("store.errors", "DriverError"),
    "LedgerError": ("store.errors", "LedgerError"),
    "SchemaError": ("store.errors", "SchemaError"),
    "StoreError": ("store.errors", "StoreError"),
    "StepPrunedError": ("store.errors", "StepPrunedError"),
    "StoreInputError": ("store.errors", "StoreInputError"),
    "TargetNotEmpty": ("store.errors", "TargetNotEmpty"),
    "GroupConflict": ("store.log.append_sql", "GroupConflict"),
    "EventStore": ("store.log.event_store", "EventStore"),
    "DeferredCancelFuture": ("store.log.futures", "DeferredCancelFuture"),
    "deferred_cancel": ("store.log.futures", "deferred_cancel"),
    "NewEvent": ("store.log.records", "NewEvent"),
    "StoredEvent": ("store.log.records", "StoredEvent"),
    "encode_data": ("store.log.records", "encode_data"),
    "queue_claims": ("store.queue.queue_claims", None),
    "follower_leadership": ("store.read_models.projection_locks", "follower_leadership"),
    "projection_page": ("store.read_models.projection_locks", "projection_page"),
    "READ_MODEL_KEYS": ("store.read_models.read_model_scan", "READ_MODEL_KEYS"),
    "TableScan": ("store.read_models.read_model_scan", "TableScan"),
    "scan": ("store.read_models.read_model_scan", "scan"),
    "console": ("store.reads.console", None),
    "export_reads": ("store.reads.export_reads", None),
    "report_failures": ("store.reads.report_reads", "report_failures"),
    "report_positions": ("store.reads.report_reads", "report_positions"),
    "report_step_metrics": ("store.reads.report_reads", "report_step_metrics"),
    "failed_session_samples": ("store.reads.tracker_reads", "failed_session_samples"),
    "OPEN_ATTEMPTS": ("store.retry", "OPEN_ATTEMPTS"),
    "is_transient": ("store.retry", "is_transient"),
    "retry_transient": ("store.retry", "retry_transient"),
    "ColumnSpec": ("store.schema.columns", "ColumnSpec"),
    "column_spec": ("store.schema.columns", "column_spec"),
    "holds_ledger": ("store.schema.ledger_file", "holds_ledger"),
    "check_schema": ("store.schema.state", "check_schema"),
    "current_revision": ("store.schema.migrate", "current_revision"),
    "head_revision": ("store.schema.state", "head_revision"),
    "upgrade": ("store.schema.migrate", "upgrade"),
    "StoredJSONError": ("store.stored_json", "StoredJSONError"),
    "load_json": ("store.stored_json", "load_json"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'store' has no attribute {name!r}") from None
    loaded = importlib.import_module(module)
    value = loaded if attribute is None else getattr(loaded, attribute)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


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
    "StepPrunedError",
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
    "describe_driver_error",
    "driver_install_hint",
    "is_transient",
    "load_json",
    "normalize_url",
    "otel_follower",
    "projection_page",
    "queue_claims",
    "raised_by_driver",
    "read_models",
    "report_failures",
    "report_positions",
    "report_step_metrics",
    "retention",
    "retry_transient",
    "scan",
    "upgrade",
]
