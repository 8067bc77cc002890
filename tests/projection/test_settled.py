"""A settled step has one owner: `sessions.projection.settled.settled_step` waits for
the step and hands back its rows, held by the projector or read back, and `Ledger.batch`,
`Ledger.metrics_dict` and the trackers (through `metrics_dict`) all ask it. So `metrics_dict` of a
step the ledger's projector holds reads no row back, and gives what the rows read back give."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, StepNotSettled, SyncLedger
from sessions.projection import settled
from sessions.projection.settled import settled_step
from sessions.trackers.content import collect_step
from store import read_models as rm
from tests.projection.test_held_rows import _open_step

STEP = ("train", 0)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the reads of a step's rows and of their events that `settled_step` makes."""
    reads: Counter[str] = Counter()

    def counting(name: str) -> Callable[..., Any]:
        real = getattr(rm, name)

        async def read(*args: Any, **kwargs: Any) -> Any:
            reads[name] += 1
            return await real(*args, **kwargs)

        return read

    for name in ("queue_rows_for", "source_events"):
        monkeypatch.setattr(settled.rm, name, counting(name))
    return reads


async def _ended_step(ledger: Ledger, sessions: int = 12) -> None:
    """A train step of `sessions` sessions (4 per uid) projected from its first session, so the
    ledger's projector holds it; every fifth session fails (a placeholder row)."""
    handles = await _open_step(ledger, sessions)
    await ledger.project()
    for i, handle in enumerate(handles):
        if i % 5 == 0:
            await handle.fail("sandbox_error")
        else:
            await handle.complete()
    await ledger.project()


async def test_metrics_dict_of_a_held_step_reads_nothing_back_and_equals_the_read_back_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'held.db'}"
    reads = _count_reads(monkeypatch)
    async with Ledger.open(url) as ledger:
        await _ended_step(ledger)
        held = await ledger.metrics_dict(*STEP, timeout=5)
        assert reads == Counter(), "the step was held, yet its rows were read back"
        batch = await ledger.batch(*STEP, timeout=5)
        assert reads == Counter(), "batch read back what the projector holds"
    async with Ledger.open(url) as reader:  # a fresh projector: holds nothing
        read_back = await reader.metrics_dict(*STEP, timeout=5)
        # the rows once, never their events: the figures need no payload
        assert reads == Counter({"queue_rows_for": 1})
        reads.clear()
        await reader.batch(*STEP, timeout=5)
        assert reads == Counter({"queue_rows_for": 1, "source_events": 1})
    assert held == read_back
    assert held["ledger/train/all/sessions/failed"] == 3.0
    assert batch.batch_size[0] == 12


async def test_the_held_rows_are_the_rows_read_back(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'rows.db'}"
    async with Ledger.open(url) as ledger:
        await _ended_step(ledger)
        held = await settled_step(ledger.projector, ledger.store, ledger.run, *STEP, timeout=5)
        bare = await settled_step(
            ledger.projector, ledger.store, ledger.run, *STEP, timeout=5, sources=False
        )
    async with Ledger.open(url) as reader:
        read = await settled_step(reader.projector, reader.store, reader.run, *STEP, timeout=5)
    assert (held.held, bare.held, read.held) == (True, True, False)
    assert len(held.rows) == 12 and held.sources and bare.sources == {}
    for mine, theirs in zip(held.rows, read.rows, strict=True):
        assert {k: mine[k] for k in mine.keys() & theirs.keys()} == {
            k: theirs[k] for k in mine.keys() & theirs.keys()
        }
    assert held.sources == read.sources
    assert [row["key"] for row in bare.rows] == [row["key"] for row in read.rows]


async def test_a_step_that_does_not_settle_raises_step_not_settled_naming_its_groups(
    tmp_path: Path,
) -> None:
    async with Ledger.open(f"sqlite+aiosqlite:///{tmp_path / 'open.db'}") as ledger:
        handles = await _open_step(ledger, 8)
        for handle in handles[:4]:
            await handle.complete()  # u0 settles, u1 stays open
        for call in (ledger.batch, ledger.metrics_dict):
            with pytest.raises(StepNotSettled, match="1 of 2 groups still unsettled") as caught:
                await call(*STEP, timeout=0.2, poll_interval=0.05)
            assert isinstance(caught.value, TimeoutError)
            assert (caught.value.pending, caught.value.groups) == (1, 2)
            assert caught.value.pending_uids == ("u1",)
        with pytest.raises(StepNotSettled, match="no sessions recorded"):
            await ledger.metrics_dict("val", 7, timeout=0.1)


async def test_the_trackers_log_what_metrics_dict_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracker's scalars come from the same settled read as `metrics_dict`: held, nothing read."""
    reads = _count_reads(monkeypatch)
    async with Ledger.open(f"sqlite+aiosqlite:///{tmp_path / 'trackers.db'}") as ledger:
        await _ended_step(ledger)
        content = await collect_step(ledger, *STEP, timeout=5)
        assert reads == Counter()
        assert dict(content.scalars) == await ledger.metrics_dict(*STEP, timeout=5)
    assert content.failed_total == 3 and len(content.failed) == 3


# ------------------------------------------------- what an unsettled group waits for (issue 39)
#: One group as generated: its group_size, the slots a session was created for, and how each
#: created session ended (None: still open).
_ENDS = st.sampled_from([None, "complete", "fail", "cancel"])


@st.composite
def _group(draw: st.DrawFn) -> tuple[int, dict[int, str | None]]:
    size = draw(st.integers(1, 5))
    created = draw(st.sets(st.integers(0, size - 1), min_size=1))
    return size, {slot: draw(_ENDS) for slot in sorted(created)}


def test_step_not_settled_tells_sessions_never_created_from_sessions_still_open(
    db_url: str,
) -> None:
    """Generated steps of groups whose sessions are open, ended, or never created: the error
    names, per unsettled uid, how many sessions are open and which slots were never created, and
    its message gives each cause only when it is there (a group whose missing session was never
    created is not said to have sessions still open)."""
    steps = iter(range(10**6))
    with SyncLedger.open(db_url, call_timeout=60) as ledger:

        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(st.lists(_group(), min_size=1, max_size=3))
        def check(groups: list[tuple[int, dict[int, str | None]]]) -> None:
            step = next(steps)
            expected_open: dict[str, int] = {}
            expected_missing: dict[str, tuple[int, ...]] = {}
            for g, (size, slots) in enumerate(groups):
                uid = f"u{g}"
                for slot, end in slots.items():
                    handle = ledger.create_session(
                        f"{step}-{g}-{slot}",
                        uid=uid,
                        session_index=slot,
                        group_size=size,
                        partition="train",
                        global_step=step,
                    )
                    if end == "complete":
                        handle.record_trajectory(prompt_ids=[1], response_ids=[2])
                        handle.complete()
                    elif end == "fail":
                        handle.fail("sandbox_error")
                    elif end == "cancel":
                        handle.cancel()
                opened = sum(end is None for end in slots.values())
                missing = tuple(i for i in range(size) if i not in slots)
                if opened:
                    expected_open[uid] = opened
                if missing:
                    expected_missing[uid] = missing
            pending = sorted(expected_open.keys() | expected_missing.keys())
            if not pending:  # every group settled: a row per session not cancelled
                rows = sum(end != "cancel" for _, slots in groups for end in slots.values())
                assert ledger.batch("train", step, timeout=5).batch_size[0] == rows
                return
            with pytest.raises(StepNotSettled) as caught:
                ledger.batch("train", step, timeout=0)
            error = caught.value
            assert error.pending_uids == tuple(pending)
            assert error.open_sessions == expected_open
            assert error.never_created == expected_missing
            message = str(error)
            assert ("still open" in message) == bool(expected_open), message
            assert ("never created" in message) == bool(expected_missing), message
            for uid in expected_missing:
                assert f"{uid}: session_index " in message

        check()


def test_the_never_created_slots_are_named_as_runs_of_indices() -> None:
    assert settled._spans((0, 1, 2, 5)) == "0-2, 5"
    assert settled._spans((3,)) == "3"
    assert settled._spans((1, 3, 4)) == "1, 3-4"
