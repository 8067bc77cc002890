"""`log_step` and `log_step_sync` written once: the synchronous face takes the async one's
parameters (the ledger's type apart), and both pass every option on."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from sessions import SyncLedger


class _Memory:
    """A tracker that keeps what it is given."""

    name = "memory"

    def __init__(self) -> None:
        self.written: list[tuple[Any, bool, bool]] = []

    def has_logged(self, key: Any) -> bool:
        return any(content.key == key for content, _, _ in self.written)

    def write(self, content: Any, *, scalars: bool = True, failed_sessions: bool = True) -> str:
        self.written.append((content, scalars, failed_sessions))
        return "logged"


def test_log_step_sync_takes_log_steps_parameters() -> None:
    """One declaration: the synchronous face has the async one's parameters, the ledger's type
    apart, and every keyword of the step's read (`collect_step`) is one of them."""
    from sessions.trackers import collect_step, log_step, log_step_sync

    mine, theirs = inspect.signature(log_step_sync), inspect.signature(log_step)
    assert mine.parameters["ledger"].annotation == "SyncLedger"
    assert theirs.parameters["ledger"].annotation == "Ledger"
    assert list(mine.parameters.values())[1:] == list(theirs.parameters.values())[1:]
    read = {
        p.name
        for p in inspect.signature(collect_step).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert read <= set(theirs.parameters)


def test_both_log_step_faces_pass_every_option_on(tmp_path: Path) -> None:
    import asyncio

    from sessions.trackers import log_step, log_step_sync
    from tests.projection.test_settled import _ended_step

    with SyncLedger.open(str(tmp_path / "log.db"), run="r") as sync:
        sync._call(_ended_step(sync.ledger), "setup")
        blocking, awaited = _Memory(), _Memory()
        options = dict(trackers=[blocking], per_reason=1, max_failed=2, scalars=False)
        done = log_step_sync(sync, "train", 0, **options)
        with pytest.raises(TypeError, match="per_reasons"):
            log_step_sync(sync, "train", 0, trackers=[_Memory()], per_reasons=1)
        with pytest.raises(TypeError, match="trackers"):
            log_step_sync(sync, "train", 0)

        async def on_loop() -> Any:
            return await log_step(sync.ledger, "train", 0, **{**options, "trackers": [awaited]})

        again = sync._call(on_loop(), "log_step")
    for logged, tracker in ((done, blocking), (again, awaited)):
        assert logged.trackers == {"memory": "logged"} and logged.scalars == {}
        [(content, scalars, failed)] = tracker.written
        assert (scalars, failed, content.per_reason, len(content.failed)) == (False, True, 1, 1)
        assert content.key == ("r", "train", 0)
    assert asyncio.iscoroutinefunction(log_step) and not asyncio.iscoroutinefunction(log_step_sync)
