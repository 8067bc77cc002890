"""Experiment trackers (issue 17): a settled step's metrics, in verl's names and the ledger's own
(`Ledger.metrics_dict`), and a sample of its failed sessions, into TensorBoard and W&B.

    trackers = [TensorBoardTracker("runs/exp-1"), WandbTracker(project="exp", mode="offline")]
    done = await log_step(ledger, "val", step, trackers=trackers)     # log_step_sync for a SyncLedger
    print(done)                                                       # what was logged, per tracker

Each tracker logs a step at most once. The packages (`tensorboard`, `wandb`: the `trackers`
extra) are imported only when a tracker is made. See docs/trackers.md.
"""

from sessions.trackers.content import (
    FAILED_COLUMNS,
    FailedSession,
    StepContent,
    collect_step,
    failed_table_key,
)
from sessions.trackers.step_log import (
    ALREADY_LOGGED,
    LOGGED,
    LoggedStep,
    MissingTrackerPackage,
    Tracker,
    log_step,
    log_step_sync,
)
from sessions.trackers.tensorboard_tracker import TensorBoardTracker
from sessions.trackers.wandb_tracker import WandbTracker

__all__ = [
    "ALREADY_LOGGED",
    "FAILED_COLUMNS",
    "LOGGED",
    "FailedSession",
    "LoggedStep",
    "MissingTrackerPackage",
    "StepContent",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "collect_step",
    "failed_table_key",
    "log_step",
    "log_step_sync",
]
