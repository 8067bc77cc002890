"""Poison logs (docs/design.md §7): an event the projector cannot project never stops projection.

Each case writes a good group through the public API with one poisoned event among it, written
straight to the `events` table as an older version or a careless writer would. Projection goes
past it; the poisoned session (if it has one still open) is failed as `unprojectable` with a
placeholder, so its group settles and `batch()` returns; `projection_errors` lists the event;
`audit` reports it; and a replay of the log reproduces every read model, the error included.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import select

from sessions import Ledger
from sessions.audit.auditing import audit
from sessions.audit.replay import replay
from sessions.batches import non_tensor
from store import NewEvent, create_engine, upgrade
from store.log.append_sql import insert_events
from store.schema.tables import projection_errors
from tests.audit.test_replay_audit import table_rows
from tests.conftest import fresh_database

STEP = 3


def _raw(
    sid: str, version: int, type_: str, data: dict[str, Any], *, uid: str = "g", schema: int = 1
) -> NewEvent:
    return NewEvent(
        str(uuid.uuid4()),
        sid,
        version,
        type_,
        schema,
        "default",
        uid,
        "val",
        STEP,
        data,
        None,
        datetime.now(timezone.utc),
    )


def _created(sid: str, index: int, *, size: int = 2, uid: str = "g", **over: Any) -> dict[str, Any]:
    return {
        "run": "default",
        "uid": uid,
        "session_index": index,
        "group_size": size,
        "partition": "val",
        "global_step": STEP,
        "data_source": None,
        "runner": None,
        "sample_index": None,
        "metadata": {},
        **over,
    }


def _trajectory(index: int = 0, **over: Any) -> dict[str, Any]:
    return {
        "index": index,
        "num_turns": 1,
        "prompt_len": 1,
        "response_len": 1,
        "has_logprobs": False,
        "trainable_tokens": 1,
        "materialization_reason": None,
        "extra": {},
        **over,
    }


#: name -> (poisoned events of session "bad", whose group is g of size 2 with good session "ok";
#:          the expected projection_errors (type, field, outcome) rows; whether "bad" has a row)
Case = tuple[Callable[[], list[NewEvent]], list[tuple[str, str | None, str]], bool]
CASES: dict[str, Case] = {
    "unknown-type": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw("bad", 2, "SessionPaused", {"why": "?"}),
        ],
        [("SessionPaused", None, "session_failed")],
        True,
    ),
    "newer-schema": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw("bad", 2, "RewardPosted", {"reward": 1.0, "info": {}}, schema=99),
        ],
        [("RewardPosted", None, "session_failed")],
        True,
    ),
    "num-turns-beyond-int32": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw("bad", 2, "TrajectoryRecorded", _trajectory(num_turns=2**40)),
        ],
        [("TrajectoryRecorded", "num_turns", "session_failed")],
        True,
    ),
    "reward-not-a-number": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw("bad", 2, "RewardPosted", {"reward": "high", "info": {}}),
        ],
        [("RewardPosted", "reward", "session_failed")],
        True,
    ),
    "missing-field": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw("bad", 2, "RewardPosted", {"info": {}}),
        ],
        [("RewardPosted", None, "session_failed")],
        True,
    ),
    "selects-unrecorded-trajectory": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw(
                "bad",
                2,
                "SessionSucceeded",
                {
                    "selected": [3],
                    "trajectory_selection": "all",
                    "score": 1.0,
                    "score_source": "external",
                    "finished": True,
                },
            ),
        ],
        [("SessionSucceeded", "selected", "session_failed")],
        True,
    ),
    "materialization-reason-too-long": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 1)),
            _raw("bad", 2, "TrajectoryRecorded", _trajectory(materialization_reason="x" * 65)),
        ],
        [("TrajectoryRecorded", "materialization_reason", "session_failed")],
        True,
    ),
    "runner-too-long": (
        lambda: [_raw("bad", 1, "SessionCreated", _created("bad", 1, runner="r" * 200))],
        [("SessionCreated", "runner", "session_failed")],
        True,
    ),
    "duplicate-session-index": (
        lambda: [_raw("bad", 1, "SessionCreated", _created("bad", 0))],
        [("SessionCreated", "session_index", "session_failed")],
        False,
    ),
    "other-group-size": (
        lambda: [_raw("bad", 1, "SessionCreated", _created("bad", 1, size=3))],
        [("SessionCreated", "group_size", "session_failed")],
        False,
    ),
    "uid-too-long": (
        lambda: [
            _raw("bad", 1, "SessionCreated", _created("bad", 0, uid="u" * 200), uid="u" * 100),
            _raw("bad", 2, "SessionCancelled", {"message": None}, uid="u" * 100),
        ],
        [("SessionCreated", "uid", "ignored"), ("SessionCancelled", None, "ignored")],
        False,
    ),
    "event-before-creation": (
        lambda: [_raw("ghost", 1, "RewardPosted", {"reward": 1.0, "info": {}})],
        [("RewardPosted", None, "ignored")],
        False,
    ),
}


async def _good(ledger: Ledger, index: int, sid: str) -> None:
    async with ledger.session(
        sid, uid="g", session_index=index, group_size=2, partition="val", global_step=STEP
    ) as s:
        await s.record_trajectory(prompt_ids=[5], response_ids=[6, 7])
        await s.post_reward(1.0)


@pytest.mark.parametrize("case", list(CASES))
async def test_projection_goes_past_a_poisoned_event_and_the_group_settles(
    db_url: str, case: str, tmp_path: Any
) -> None:
    poison, expected_errors, bad_has_row = CASES[case]
    async with Ledger.open(db_url) as ledger:
        await _good(ledger, 0, "ok")
        async with ledger.engine.begin() as conn:  # written as stored, past the recorder's checks
            await insert_events(conn, poison())
        if not bad_has_row:  # the group's real second member
            await _good(ledger, 1, "ok-2")
        projected = await ledger.project()
        assert projected > 0
        batch = await ledger.batch(
            "val", STEP, timeout=10
        )  # the group settled: no wait for a hung session
        keys = sorted(non_tensor(batch, "key"))
        assert keys == ["g_0_0", "g_1_0"]
        placeholders = dict(zip(non_tensor(batch, "key"), batch["is_placeholder"].tolist()))
        assert placeholders["g_1_0"] is bad_has_row
        if bad_has_row:
            reasons = dict(zip(non_tensor(batch, "key"), non_tensor(batch, "failure_reason")))
            assert reasons["g_1_0"] == "unprojectable"
            assert batch["rm_scores"].sum(-1).tolist()[keys.index("g_1_0")] == 0.0
        async with ledger.engine.connect() as conn:
            errors = [
                (r.type, r.field, r.outcome)
                for r in await conn.execute(
                    select(projection_errors).order_by(projection_errors.c.position)
                )
            ]
        assert errors == expected_errors
        # a good session recorded after the poison still projects
        report = await audit(ledger.engine)
        reported = [
            (d.field, d.position)
            for d in report.divergences
            if d.table == "events" and d.key.startswith("position")
        ]
        assert len(reported) == len(expected_errors), report.divergences
        assert [e["outcome"] for e in report.quarantined] == [
            outcome for _t, _f, outcome in expected_errors
        ]
        assert not [d for d in report.divergences if d.table != "events"], (
            "the stored read models must equal a replay"
        )
        source = ledger.engine
        with fresh_database("sqlite", tmp_path, "replayed") as target_url:
            target = create_engine(target_url)
            try:
                await upgrade(target)
                await replay(source, target)
                want, got = await table_rows(source), await table_rows(target)
                for name in want:
                    if name != "checkpoints":
                        assert got[name] == want[name], name
            finally:
                await target.dispose()


async def test_events_after_the_poison_keep_projecting(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        async with ledger.engine.begin() as conn:
            await insert_events(
                conn,
                [
                    _raw("bad", 1, "SessionCreated", _created("bad", 1)),
                    _raw("bad", 2, "SessionPaused", {}),
                ],
            )
        for step_index in range(3):
            async with ledger.session(
                f"later-{step_index}",
                uid=f"later{step_index}",
                session_index=0,
                group_size=1,
                partition="train",
                global_step=0,
            ) as s:
                await s.record_trajectory(prompt_ids=[1], response_ids=[2])
                await s.post_reward(0.5)
        await ledger.project()
        batch = await ledger.batch("train", 0, timeout=10)
        assert sorted(non_tensor(batch, "key")) == ["later0_0_0", "later1_0_0", "later2_0_0"]
        # the quarantined session's later events are skipped, not listed again
        async with ledger.engine.begin() as conn:
            await insert_events(conn, [_raw("bad", 3, "RewardPosted", {"reward": 1.0, "info": {}})])
        await ledger.project()
        async with ledger.engine.connect() as conn:
            assert len((await conn.execute(select(projection_errors))).all()) == 1


async def test_audit_reports_unprojectable_events_past_the_checkpoint(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        await _good(ledger, 0, "ok")
        await ledger.project()
        async with ledger.engine.begin() as conn:
            await insert_events(
                conn,
                [
                    _raw("bad", 1, "SessionCreated", _created("bad", 1)),
                    _raw("bad", 2, "TrajectoryRecorded", _trajectory(num_turns=-1)),
                ],
            )
        report = await audit(ledger.engine)  # not projected yet
        assert [(e["type"], e["field"]) for e in report.quarantined] == [
            ("TrajectoryRecorded", "num_turns")
        ]
        assert not report.ok
