"""The TRL adapter's errors, both under `LedgerError`: a wrong setup, and a runner's bad output."""

from __future__ import annotations

from sessions import LedgerError, RolloutFailure
from sessions.vocabulary import INVALID_OUTPUT

__all__ = ["RunnerOutputError", "TRLSetupError"]


class TRLSetupError(LedgerError, ValueError):
    """The trainer or the wrapper is configured in a way the ledger cannot record honestly; the
    message names the setting and what to set instead."""


class RunnerOutputError(RolloutFailure):
    """A runner returned something that is not one completion (`docs/trl.md` lists the keys): the
    session fails as `invalid_output`, with a placeholder, and the step goes on."""

    reason = INVALID_OUTPUT
