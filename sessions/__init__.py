"""rollout-ledger: every rollout session a persisted, event-sourced state machine.

Public API::

    from sessions import Ledger, SandboxError, InvalidTransition, ConcurrencyError
    from sessions import SyncLedger          # the same ledger for synchronous code (verl's trainer loop)

Names that need torch (batch building, the GRPO reference advantage, the TransferQueue sink) are
imported on first use, so recording sessions never pays torch's import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from sessions.config import LedgerConfig
from sessions.errors import (
    AppendOutcomeUnknown,
    BatchPruned,
    ConcurrencyError,
    ConfigError,
    DamagedData,
    InvalidArgument,
    InvalidArgumentType,
    InvalidInput,
    InvalidTransition,
    LedgerClosed,
    LedgerError,
    LedgerTimeout,
    MissingDependency,
    NotFound,
    ProjectionError,
    RolloutFailure,
    RowIndexError,
    SandboxError,
    SchemaError,
    StepNotSettled,
    StoreError,
    UnknownEventError,
    UsageError,
)
from sessions.failure_policy import MetricPolicy, RetryPolicy
from sessions.ledger import DEFAULT_RUN, Ledger
from sessions.placeholder import PlaceholderPolicy
from sessions.projection.metrics import MetricRow
from sessions.projection.projector import Projector
from sessions.queues.sinks import InProcessQueue, QueueItem, QueueSink
from sessions.recorder import SessionHandle, SessionOutcome
from sessions.runs.fingerprint import RunConfigMismatch
from sessions.runs.retention import PruneReport, RetentionPolicy, prune
from sessions.sync import SessionProxy, SyncLedger, SyncSession

_LAZY = {
    "BatchRow": "sessions.batches",
    "BatchTooLongError": "sessions.batches",
    "build_padded": "sessions.batches",
    "build_jagged": "sessions.batches",
    "concat_batches": "sessions.batches",
    "pad_to_widths": "sessions.batches",
    "select_rows": "sessions.batches",
    "split_batch": "sessions.batches",
    "to_data_proto": "sessions.integrations.verl",
    "densify": "sessions.batches",
    "to_plain_dict": "sessions.batches",
    "grpo_outcome_advantage": "sessions.batches.advantage",
    "QueueConsumer": "sessions.queues.consumer",
    "ExportError": "sessions.export",
    "ExportSummary": "sessions.export",
    "export_dataset": "sessions.export",
    "LoggedStep": "sessions.trackers",
    "TensorBoardTracker": "sessions.trackers",
    "WandbTracker": "sessions.trackers",
    "log_step": "sessions.trackers",
    "log_step_sync": "sessions.trackers",
    "TransferQueueSink": "sessions.integrations.transferqueue",
    "start_transferqueue": "sessions.integrations.transferqueue",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sessions' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AppendOutcomeUnknown",
    "BatchPruned",
    "ConcurrencyError",
    "ConfigError",
    "DEFAULT_RUN",
    "DamagedData",
    "InProcessQueue",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidInput",
    "InvalidTransition",
    "Ledger",
    "LedgerConfig",
    "LedgerClosed",
    "LedgerError",
    "LedgerTimeout",
    "MetricPolicy",
    "MetricRow",
    "MissingDependency",
    "NotFound",
    "PlaceholderPolicy",
    "ProjectionError",
    "Projector",
    "PruneReport",
    "QueueItem",
    "QueueSink",
    "RetentionPolicy",
    "RetryPolicy",
    "RolloutFailure",
    "RowIndexError",
    "RunConfigMismatch",
    "SandboxError",
    "SchemaError",
    "SessionHandle",
    "SessionOutcome",
    "SessionProxy",
    "StepNotSettled",
    "StoreError",
    "SyncLedger",
    "SyncSession",
    "UnknownEventError",
    "UsageError",
    "prune",
    *_LAZY,
]
