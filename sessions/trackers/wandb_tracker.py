"""`WandbTracker`: a step's scalars and failed-sessions table into a Weights & Biases run.

Works offline (`WANDB_MODE=offline`: the run is written to `WANDB_DIR` and can be synced later).
Scalars go in at `step=global_step`, as verl's `Tracking` logs its own, so both land in one row
of the run's history (values as given, float64); the sample of failed sessions is a `wandb.Table`,
its texts shown as the terminal shows them (controls and bidi overrides escaped).
W&B drops a log for a step earlier than the run's current one; this tracker does not send it and
says so (a warning, and the status in `LoggedStep.trackers`) instead of losing it silently.
"""

from __future__ import annotations

import logging
from typing import Any

from sessions.errors import ConfigError
from sessions.trackers.content import FAILED_COLUMNS, StepContent, StepKey, failed_table_key
from sessions.trackers.step_log import LOGGED, require

__all__ = ["WandbTracker"]

log = logging.getLogger("sessions.trackers")


class WandbTracker:
    """Log steps into `run` (an open run, e.g. `wandb.run` that verl's `Tracking` started), or into
    a run `wandb.init(**init)` starts here, which `close()` then finishes."""

    def __init__(self, run: Any = None, **init: Any) -> None:
        self._wandb = require("wandb", "WandbTracker")
        if run is not None and init:
            raise ConfigError(
                f"WandbTracker: given an open run, it starts none; drop {sorted(init)}"
            )
        self._owned = run is None
        self.run = self._wandb.init(**init) if run is None else run
        self._logged: set[StepKey] = set()

    @property
    def name(self) -> str:
        return f"wandb:{self.run.id}"

    def has_logged(self, key: StepKey) -> bool:
        return key in self._logged

    def write(
        self, content: StepContent, *, scalars: bool = True, failed_sessions: bool = True
    ) -> str:
        step = content.global_step
        assert step is not None  # log_step refuses step-less content
        current = self.run.step
        if step < current:
            status = (
                f"skipped: the W&B run is at step {current} and W&B drops a log for an earlier step; "
                "log each step's partitions before the next step's"
            )
            log.warning(
                "rollout-ledger %s %s step %s: %s", self.name, content.partition, step, status
            )
            return status
        data: dict[str, Any] = dict(content.scalars) if scalars else {}
        if failed_sessions:
            rows = [failed.shown_row() for failed in content.failed]
            data[failed_table_key(content.partition)] = self._wandb.Table(
                columns=list(FAILED_COLUMNS), data=rows
            )
        self.run.log(data, step=step)
        self._logged.add(content.key)
        return LOGGED

    def close(self) -> None:
        """Finish the run if this tracker started it (a run passed in is left to its owner)."""
        if self._owned:
            self.run.finish()

    def __enter__(self) -> WandbTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
