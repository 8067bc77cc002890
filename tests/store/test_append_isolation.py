"""One caller's bad append never fails another's (docs/design.md §4), on both backends.

Below the recorder (which refuses such values before they reach the store), the event store
itself must isolate a request the database or its driver refuses: many good appends and one bad
one go into the same group commit; the bad one fails alone, every good one commits.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest

from store import EventStore, NewEvent, StoreError, create_engine, upgrade
from tests.conftest import backend_of

GOOD = 60


def _event(sid: str, **over: Any) -> NewEvent:
    fields: dict[str, Any] = {
        "event_id": str(uuid.uuid4()),
        "session_id": sid,
        "version": 1,
        "type": "SessionStarted",
        "schema_version": 1,
        "run": "r",
        "uid": f"u{sid}",
        "partition": "val",
        "global_step": 0,
        "data": {"attempt": None, "timeout_s": None},
        "payload": None,
        "recorded_at": datetime.now(timezone.utc),
    }
    fields.update(over)
    return NewEvent(**fields)


#: Values a backend or its driver refuses for one row: SQLite's driver cannot bind a lone
#: surrogate or an integer beyond 64 bits; PostgreSQL refuses NUL in text and out-of-range ints.
BAD = {
    "step-beyond-int64": {"global_step": 2**63},
    "lone-surrogate-in-session-id": {"session_id": "bad-\udc80"},
    "nul-in-uid": {"uid": "u\x00"},
    "uid-longer-than-its-column": {"uid": "u" * 300},
}


@pytest.mark.parametrize("bad", list(BAD))
async def test_a_bad_append_among_many_good_ones_fails_alone(db_url: str, bad: str) -> None:
    engine = create_engine(db_url)
    store = EventStore(engine)
    try:
        await upgrade(engine)
        override = BAD[bad]
        bad_event = _event(
            override.get("session_id", "bad"),
            **{k: v for k, v in override.items() if k != "session_id"},
        )
        if bad == "uid-longer-than-its-column" and backend_of(db_url) == "sqlite":
            pytest.skip(
                "SQLite does not enforce VARCHAR lengths; the recorder's declaration does (tests/domain/test_bad_input.py)"
            )
        if bad == "nul-in-uid" and backend_of(db_url) == "sqlite":
            pytest.skip(
                "SQLite stores NUL in text; the recorder's declaration refuses it for both (tests/domain/test_bad_input.py)"
            )
        good = [_event(f"good-{i}") for i in range(GOOD)]
        requests = [*good[: GOOD // 2], bad_event, *good[GOOD // 2 :]]
        results = await asyncio.gather(
            *(store.append(e.session_id, 0, [e]) for e in requests), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], StoreError), results
        assert "bad" in str(failed[0]) or repr(bad_event.session_id) in str(failed[0])
        assert results[GOOD // 2] is failed[0], "the failure belongs to the bad request"
        for event in good:
            assert [s.event_id for s in await store.read_stream(event.session_id)] == [
                event.event_id
            ]
        assert await store.last_position() >= GOOD
    finally:
        await store.close()
        await engine.dispose()
