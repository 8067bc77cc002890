"""rollout-ledger: every rollout session a persisted, event-sourced state machine.

Public API::

    from sessions import Ledger, SandboxError, InvalidTransition, ConcurrencyError
    from sessions import SyncLedger          # the same ledger for synchronous code (verl's trainer loop)

Every name is imported on first use (PEP 562): recording sessions never pays torch's import time
(batch building, the GRPO reference advantage, the TransferQueue sink), and a command that needs
no database (the CLI's `--help`, an argument error) pays none of SQLAlchemy's either. Editors and
type checkers read the names' types from `__init__.pyi`, which `python -m sessions.ledger.stubgen`
writes from the same table.
"""

from __future__ import annotations

from sessions.lazy import lazy_names

#: Each public name -> the module that defines it; loaded on first use.
_NAMES: dict[str, str] = {
    "LedgerConfig": "sessions.ledger.config",
    "AppendOutcomeUnknown": "sessions.errors",
    "BatchPruned": "sessions.errors",
    "ConcurrencyError": "sessions.errors",
    "StepPrunedError": "sessions.errors",
    "ConfigError": "sessions.errors",
    "DamagedData": "sessions.errors",
    "InvalidArgument": "sessions.errors",
    "InvalidArgumentType": "sessions.errors",
    "InvalidInput": "sessions.errors",
    "InvalidTransition": "sessions.errors",
    "LedgerClosed": "sessions.errors",
    "LedgerError": "sessions.errors",
    "LedgerTimeout": "sessions.errors",
    "MissingDependency": "sessions.errors",
    "NotFound": "sessions.errors",
    "ProjectionError": "sessions.errors",
    "RolloutFailure": "sessions.runner_failure",
    "RowIndexError": "sessions.errors",
    "SandboxError": "sessions.runner_failure",
    "ServerConnectionError": "sessions.runner_failure",
    "SchemaError": "sessions.errors",
    "RunHalted": "sessions.errors",
    "StepNotSettled": "sessions.errors",
    "StoreError": "sessions.errors",
    "UnknownEventError": "sessions.errors",
    "UsageError": "sessions.errors",
    "MetricPolicy": "sessions.failure_policy",
    "RetryPolicy": "sessions.failure_policy",
    "DEFAULT_RUN": "sessions.ledger",
    "Ledger": "sessions.ledger",
    "PlaceholderPolicy": "sessions.placeholder",
    "MetricRow": "sessions.projection.metrics",
    "Projector": "sessions.projection.projector",
    "InProcessQueue": "sessions.queues.sinks",
    "QueueItem": "sessions.queues.sinks",
    "QueueSink": "sessions.queues.sinks",
    "SessionHandle": "sessions.recorder",
    "SessionOutcome": "sessions.recorder",
    "RunConfigMismatch": "sessions.runs.fingerprint",
    "PruneReport": "sessions.runs.pruning",
    "RetentionPolicy": "sessions.runs.retention",
    "CircuitBreaker": "sessions.runs.breaker",
    "prune": "sessions.runs.pruning",
    "SessionProxy": "sessions.ledger.sync",
    "SyncLedger": "sessions.ledger.sync",
    "SyncSession": "sessions.ledger.sync",
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

__getattr__, __dir__, __all__ = lazy_names(globals(), _NAMES)
