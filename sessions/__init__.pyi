# Generated from sessions/__init__.py by `python -m sessions.ledger.stubgen`: edit that, not this.
"""rollout-ledger: every rollout session a persisted, event-sourced state machine.

Public API::

    from sessions import Ledger, SandboxError, InvalidTransition, ConcurrencyError
    from sessions import SyncLedger          # the same ledger for synchronous code (verl's trainer loop)

Every name is imported on first use (PEP 562): recording sessions never pays torch's import time
(batch building, the GRPO reference advantage, the TransferQueue sink), and a command that needs
no database (the CLI's `--help`, an argument error) pays none of SQLAlchemy's either. Editors and
type checkers read the names' types from `__init__.pyi`, which `python -m sessions.ledger.stubgen`
writes from the same table."""

from sessions.batches import (
    BatchRow,
    BatchTooLongError,
    build_jagged,
    build_padded,
    concat_batches,
    densify,
    pad_to_widths,
    select_rows,
    split_batch,
    to_plain_dict,
)
from sessions.batches.advantage import grpo_outcome_advantage
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
    RowIndexError,
    RunHalted,
    SchemaError,
    StepNotSettled,
    StepPrunedError,
    StoreError,
    UnknownEventError,
    UsageError,
)
from sessions.export import ExportError, ExportSummary, export_dataset
from sessions.failure_policy import MetricPolicy, RetryPolicy
from sessions.integrations.transferqueue import TransferQueueSink, start_transferqueue
from sessions.integrations.verl import to_data_proto
from sessions.ledger import DEFAULT_RUN, Ledger
from sessions.ledger.config import LedgerConfig
from sessions.ledger.sync import SessionProxy, SyncLedger, SyncSession
from sessions.placeholder import PlaceholderPolicy
from sessions.projection.metrics import MetricRow
from sessions.projection.projector import Projector
from sessions.queues.consumer import QueueConsumer
from sessions.queues.sinks import InProcessQueue, QueueItem, QueueSink
from sessions.recorder import SessionHandle, SessionOutcome
from sessions.runner_failure import RolloutFailure, SandboxError, ServerConnectionError
from sessions.runs.breaker import CircuitBreaker
from sessions.runs.fingerprint import RunConfigMismatch
from sessions.runs.pruning import PruneReport, prune
from sessions.runs.retention import RetentionPolicy
from sessions.trackers import LoggedStep, TensorBoardTracker, WandbTracker, log_step, log_step_sync

__all__ = [
    "AppendOutcomeUnknown",
    "BatchPruned",
    "BatchRow",
    "BatchTooLongError",
    "CircuitBreaker",
    "ConcurrencyError",
    "ConfigError",
    "DEFAULT_RUN",
    "DamagedData",
    "ExportError",
    "ExportSummary",
    "InProcessQueue",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidInput",
    "InvalidTransition",
    "Ledger",
    "LedgerClosed",
    "LedgerConfig",
    "LedgerError",
    "LedgerTimeout",
    "LoggedStep",
    "MetricPolicy",
    "MetricRow",
    "MissingDependency",
    "NotFound",
    "PlaceholderPolicy",
    "ProjectionError",
    "Projector",
    "PruneReport",
    "QueueConsumer",
    "QueueItem",
    "QueueSink",
    "RetentionPolicy",
    "RetryPolicy",
    "RolloutFailure",
    "RowIndexError",
    "RunConfigMismatch",
    "RunHalted",
    "SandboxError",
    "SchemaError",
    "ServerConnectionError",
    "SessionHandle",
    "SessionOutcome",
    "SessionProxy",
    "StepNotSettled",
    "StepPrunedError",
    "StoreError",
    "SyncLedger",
    "SyncSession",
    "TensorBoardTracker",
    "TransferQueueSink",
    "UnknownEventError",
    "UsageError",
    "WandbTracker",
    "build_jagged",
    "build_padded",
    "concat_batches",
    "densify",
    "export_dataset",
    "grpo_outcome_advantage",
    "log_step",
    "log_step_sync",
    "pad_to_widths",
    "prune",
    "select_rows",
    "split_batch",
    "start_transferqueue",
    "to_data_proto",
    "to_plain_dict",
]
