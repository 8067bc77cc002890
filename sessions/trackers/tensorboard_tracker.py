"""`TensorBoardTracker`: a step's scalars and failed-sessions table into TensorBoard event files.

Written with torch's `SummaryWriter` (the `tensorboard` package must be installed: the
`trackers` extra), as verl's own `TensorboardLogger` writes, so the ledger's figures sit beside
verl's under the same step. Scalars are TensorBoard's usual float32 (`simple_value`); the table is
markdown for the text plugin. The steps logged are also kept in a small file in the log directory
(`_MANIFEST`), so a restarted trainer that logs a step again does not write it twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sessions.errors import ConfigError
from sessions.trackers.content import (
    StepContent,
    StepKey,
    failed_sessions_markdown,
    failed_table_key,
)
from sessions.trackers.step_log import LOGGED, require

__all__ = ["TensorBoardTracker"]

#: The file, in the log directory, listing the steps this tracker has logged there (JSON lines).
_MANIFEST = "rollout-ledger-steps.jsonl"


class TensorBoardTracker:
    """Log steps into `logdir` (a new `SummaryWriter`), or into an open `writer` (e.g. verl's
    `TensorboardLogger().writer`), which is then left open by `close()`."""

    def __init__(self, logdir: str | os.PathLike[str] | None = None, *, writer: Any = None) -> None:
        if (logdir is None) == (writer is None):
            raise ConfigError(
                "TensorBoardTracker: give a log directory or an open SummaryWriter (writer=...), one of them"
            )
        self._owned = writer is None
        if writer is None:
            tensorboard = require("torch.utils.tensorboard", "TensorBoardTracker")
            writer = tensorboard.SummaryWriter(log_dir=str(logdir))
        self.writer = writer
        self.logdir = Path(writer.log_dir)
        self._logged = _read_manifest(self.logdir / _MANIFEST)

    @property
    def name(self) -> str:
        return f"tensorboard:{self.logdir}"

    def has_logged(self, key: StepKey) -> bool:
        return key in self._logged

    def write(
        self, content: StepContent, *, scalars: bool = True, failed_sessions: bool = True
    ) -> str:
        step = content.global_step
        if scalars:
            for tag in sorted(content.scalars):
                self.writer.add_scalar(tag, float(content.scalars[tag]), global_step=step)
        if failed_sessions:
            self.writer.add_text(
                failed_table_key(content.partition),
                failed_sessions_markdown(content),
                global_step=step,
            )
        self.writer.flush()  # on disk before the step is marked logged: at worst a crash logs it twice
        run, partition, global_step = content.key
        with open(self.logdir / _MANIFEST, "a", encoding="utf-8") as manifest:
            manifest.write(
                json.dumps({"run": run, "partition": partition, "global_step": global_step}) + "\n"
            )
        self._logged.add(content.key)
        return LOGGED

    def close(self) -> None:
        """Flush; close the writer if this tracker opened it."""
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self) -> TensorBoardTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_manifest(path: Path) -> set[StepKey]:
    """The steps logged into this directory before; a line cut short by a crash is ignored."""
    logged: set[StepKey] = set()
    if not path.exists():
        return logged
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
            logged.add((entry["run"], entry["partition"], entry["global_step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return logged
