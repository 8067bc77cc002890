"""The circuit breaker (`sessions.runs.breaker`, `sessions.runs.halts`; docs/failures.md).

The fold is held to a from-scratch reading of its rule at every position of generated outcome
streams; the live breaker halts a ledger's run where the fold says, records why in the run's
stream, refuses new sessions and the step's batch and metrics with `RunHalted`, reads the same
halt through a ledger with other settings, and re-arms on the next launch under the same
fingerprint. Both backends.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from sessions import Ledger, RunHalted
from sessions.audit.auditing import audit
from sessions.errors import ConfigError, LedgerError
from sessions.runs.breaker import (
    CANCELLED,
    FAILED,
    SUCCEEDED,
    CircuitBreaker,
    Outcome,
    trips,
)
from sessions.runs.fingerprint import run_stream
from store.schema.tables import events

ORIGINS = ("infra", "policy")
REASONS = ("sandbox_error", "connection_error", "runner_error", "invalid_output", "orphaned")

outcomes = st.lists(
    st.one_of(
        st.just("launch"),
        st.tuples(
            st.sampled_from((SUCCEEDED, FAILED, FAILED, CANCELLED)),
            st.sampled_from(ORIGINS),
            st.sampled_from(REASONS),
        ),
    ),
    max_size=120,
)
breakers = st.builds(
    CircuitBreaker,
    consecutive=st.none() | st.integers(1, 8),
    window=st.none() | st.integers(1, 12),
    max_share=st.floats(0.05, 1.0),
    origins=st.sampled_from([("infra",), ("policy",), ("infra", "policy")]),
    reasons=st.sampled_from([(), ("runner_error",)]),
)


def _stream(items: list[Any]) -> list[Outcome | str]:
    out: list[Outcome | str] = []
    for position, item in enumerate(items, start=1):
        if item == "launch":
            out.append("launch")
        else:
            kind, origin, reason = item
            failed = kind == FAILED
            out.append(
                Outcome(
                    position,
                    kind,
                    f"s{position}",
                    reason if failed else None,
                    origin if failed else None,
                    "boom" if failed else "",
                )
            )
    return out


def _by_the_rule(breaker: CircuitBreaker, stream: list[Outcome | str]) -> list[tuple[int, str]]:
    """The trips, read off the rule from scratch at each position: over the ends since the last
    launch (cancellations and orphans skipped), `consecutive` counted failures since the last success, or a
    counted share of the last `window` ends; halted until the next launch."""
    found: list[tuple[int, str]] = []
    since: list[Outcome] = []
    halted = False
    for item in stream:
        if isinstance(item, str):
            since, halted = [], False
            continue
        if item.kind == CANCELLED or item.reason == "orphaned" or halted:
            continue  # an earlier launch's session failed as orphaned says nothing of now
        since.append(item)

        def counted(o: Outcome) -> bool:
            return o.kind == FAILED and (o.origin in breaker.origins or o.reason in breaker.reasons)

        streak = 0
        for o in reversed(since):
            if o.kind == SUCCEEDED:
                break
            streak += counted(o)
        rule = None
        if breaker.consecutive is not None and streak >= breaker.consecutive:
            rule = "consecutive"
        elif breaker.window is not None and len(since) >= breaker.window:
            last = since[-breaker.window :]
            if sum(counted(o) for o in last) >= breaker.max_share * breaker.window:
                rule = "share"
        if rule is not None:
            found.append((item.position, rule))
            halted = True
    return found


@settings(max_examples=300, deadline=None)
@given(breaker=breakers, items=outcomes)
def test_the_breaker_trips_exactly_where_its_rule_says(
    breaker: CircuitBreaker, items: list[Any]
) -> None:
    stream = _stream(items)
    assert [(t.tripped_at, t.rule) for t in trips(breaker, stream)] == _by_the_rule(breaker, stream)


@settings(max_examples=200, deadline=None)
@given(breaker=breakers, items=outcomes, where=st.lists(st.integers(0, 200), max_size=10))
def test_cancellations_never_trip_it_nor_move_a_trip(
    breaker: CircuitBreaker, items: list[Any], where: list[int]
) -> None:
    """Cancellations inserted anywhere: no trip lands on one, and the trips are the same ends."""
    plain = _stream(items)
    with_cancels = list(items)
    for index in sorted(where, reverse=True):
        with_cancels.insert(min(index, len(with_cancels)), (CANCELLED, "infra", "sandbox_error"))
    stream = _stream(with_cancels)
    kinds = {o.position: o.kind for o in stream if isinstance(o, Outcome)}
    tripped = trips(breaker, stream)
    assert all(kinds[t.tripped_at] != CANCELLED for t in tripped)

    def ends(found: list[Any], source: list[Outcome | str]) -> list[str]:
        ids = {o.position: o for o in source if isinstance(o, Outcome)}
        return [f"{ids[t.tripped_at].kind}/{ids[t.tripped_at].reason}/{t.rule}" for t in found]

    assert len(tripped) == len(trips(breaker, plain))
    assert ends(tripped, stream) == ends(trips(breaker, plain), plain)


@pytest.mark.parametrize(
    "bad",
    [
        {"consecutive": 0},
        {"window": -1},
        {"max_share": 0.0},
        {"max_share": 1.5},
        {"origins": ("cosmic",)},
        {"origins": (), "reasons": ()},
    ],
)
def test_a_rule_that_cannot_work_is_refused_by_name(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="CircuitBreaker"):
        CircuitBreaker(**bad)


def test_a_typo_in_the_breaker_settings_is_refused_before_the_run() -> None:
    from sessions import LedgerConfig

    with pytest.raises(ConfigError, match=r"unknown keys \['consecutve'\]"):
        LedgerConfig(circuit_breaker={"consecutve": 3})


# --- the live breaker, both backends ---------------------------------------------------------
async def _session(ledger: Any, run: str, n: int, step: int = 0) -> Any:
    return await ledger.create_session(
        f"{run}-{uuid.uuid4().hex[:6]}-{n}",
        uid=f"u{n}",
        session_index=0,
        group_size=1,
        partition="train",
        global_step=step,
    )


async def _tripped(ledger: Any, run: str) -> list[Any]:
    from sessions import events as ev

    stored = await ledger.store.read_stream(run_stream(run))
    return [ev.decode(s).event for s in stored if s.type == "BreakerTripped"]


async def test_a_run_whose_sandbox_is_down_halts_and_resumes_on_its_next_launch(
    db_url: str,
) -> None:
    run = f"outage{uuid.uuid4().hex[:6]}"
    breaker = CircuitBreaker(consecutive=4, window=None)
    async with Ledger.open(db_url, run=run, circuit_breaker=breaker, launch="first") as ledger:
        ok = await _session(ledger, run, 0)
        await ok.post_reward(1.0)
        await ok.complete()
        policy = await _session(ledger, run, 1)
        await policy.fail("invalid_output")  # a policy failure: not counted, breaks nothing
        ends = []
        for n in range(2, 6):
            handle = await _session(ledger, run, n)
            await handle.fail("sandbox_error", message=f"sandbox {n} refused the connection")
            ends.append(handle.session_id)
        with pytest.raises(RunHalted) as halted:
            await _session(ledger, run, 6)
        assert isinstance(halted.value, LedgerError)  # under the error root
        text = str(halted.value)
        assert "4 counted failures in a row" in text and "sandbox_error ×4" in text
        assert "sandbox 5 refused the connection" in text and "new launch" in text
        (record,) = await _tripped(ledger, run)
        fifth = await ledger.store.read_stream(ends[-1])
        assert record.tripped_at == max(s.position for s in fifth if s.type == "SessionFailed")
        assert record.rule == "consecutive" and record.by_reason == {"sandbox_error": 4}
        with pytest.raises(RunHalted):  # the step saw the failures: not a batch to train on
            await ledger.batch("train", 0, timeout=5)
        with pytest.raises(RunHalted):
            await ledger.metrics_dict("train", 0, timeout=5)
    # a reader with other settings reads the run's own rule and halt
    async with Ledger.open(db_url, run=run, circuit_breaker=None, migrate=False) as reader:
        with pytest.raises(RunHalted):
            await reader.batch("train", 0, timeout=5)
    # the next launch re-arms it, under the same fingerprint
    async with Ledger.open(db_url, run=run, circuit_breaker=breaker, launch="second") as ledger:
        handle = await _session(ledger, run, 7, step=1)
        await handle.post_reward(1.0)
        await handle.complete()
        batch = await ledger.batch("train", 1, timeout=10)
        assert batch.batch_size[0] == 1
        assert len(await _tripped(ledger, run)) == 1
        assert (await audit(ledger.engine)).ok
        # a trip recorded where the fold does not trip is found by the audit
        moved = {**record.to_data(), "tripped_at": record.tripped_at - 1}
        async with ledger.engine.begin() as conn:
            await conn.execute(
                update(events).where(events.c.type == "BreakerTripped").values(data=moved)
            )
        found = (await audit(ledger.engine)).divergences
        assert [d.field for d in found] == ["tripped_at"], found


async def test_the_recorded_halt_is_where_a_replay_of_the_log_trips(db_url: str) -> None:
    """The share rule over a run with successes, policy failures, cancellations and infra
    failures: the fold over the log's ends (read back in position order) trips at the position
    `BreakerTripped` recorded."""
    from sessions import events as ev
    from sessions.runs.halts import outcome_of

    run = f"share{uuid.uuid4().hex[:6]}"
    breaker = CircuitBreaker(consecutive=None, window=6, max_share=0.5)
    plan = ["ok", "infra", "policy", "cancel", "infra", "ok", "infra", "infra", "ok", "infra"]
    async with Ledger.open(db_url, run=run, circuit_breaker=breaker) as ledger:
        with pytest.raises(RunHalted):
            for n, kind in enumerate(plan):
                handle = await _session(ledger, run, n)
                if kind == "ok":
                    await handle.post_reward(0.5)
                    await handle.complete()
                elif kind == "cancel":
                    await handle.cancel("stopped")
                else:
                    await handle.fail("connection_error" if kind == "infra" else "invalid_output")
            await _session(ledger, run, len(plan))
        (record,) = await _tripped(ledger, run)
        stored = await ledger.store.read_from(0, limit=10_000)
    ends = [
        outcome_of(s.position, s.session_id, s.type, ev.decode(s).event.to_data())
        for s in stored
        if s.type in ev.TERMINAL_EVENTS and s.session_id.startswith(run)
    ]
    replayed = trips(breaker, ends)
    assert [t.tripped_at for t in replayed] == [record.tripped_at]
    assert replayed[0].rule == record.rule == "share"
    assert replayed[0].window_failures == record.window_failures == 3
