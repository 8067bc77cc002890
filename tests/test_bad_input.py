"""Bad input, in one matrix: each case raises a clear error naming the field and writes nothing.

The identity and trajectory cases of tests/test_recorder.py (`BAD_IDENTITIES`,
`BAD_TRAJECTORIES`) are imported, not copied, and joined here with rewards, duplicate ids and
the size caps (`Ledger.open(max_event_bytes=…, max_session_events=…, max_session_bytes=…)`), so
each case is its own test. Damage to the stored log (malformed JSON, an event type or schema
version from the future, data of the wrong shape) is tested on a database of its own.
docs/reliability.md lists every case.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pytest
from sqlalchemy import insert, select, text, update
from sqlalchemy.exc import DBAPIError

from sessions import InvalidInput, Ledger, UnknownEventError
from sessions.audit.auditing import audit
from sessions.recorder import MAX_EVENT_BYTES, MAX_SESSION_BYTES, MAX_SESSION_EVENTS, Limits
from store.engine import StoredJSONError
from store.tables import events
from tests import crash_workers as cw
from tests.test_recorder import BAD_IDENTITIES, BAD_TRAJECTORIES

KW: dict[str, Any] = {"uid": "u1", "session_index": 0, "group_size": 1, "partition": "val", "global_step": 0}
CAPS = {"max_event_bytes": 16 * 1024, "max_session_events": 8, "max_session_bytes": 48 * 1024}
GOOD = {"prompt_ids": [1, 2], "response_ids": [3, 4]}
BLOB = "x" * 20_000  # JSON over max_event_bytes


@pytest.fixture
async def ledger(module_db_url: str) -> AsyncIterator[Ledger]:
    async with Ledger.open(module_db_url, **CAPS) as opened:
        yield opened


Act = Callable[[Ledger, str, Any], Awaitable[Any]]


@dataclass(frozen=True)
class Case:
    id: str
    field: str
    act: Act  # (ledger, session_id, handle or None) -> raises InvalidInput
    session: bool = True  # create a running session first and hand its handle to `act`
    setup: Act | None = None  # more valid commands on that session first
    mentions: tuple[str, ...] = ()  # further text the message must hold


def _create(overrides: dict[str, Any]) -> Act:
    async def act(ledger: Ledger, sid: str, _handle: Any) -> None:
        kwargs = {**KW, "group_size": 4, **overrides}
        await ledger.create_session(kwargs.pop("session_id", sid), **kwargs)
    return act


def _record(overrides: dict[str, Any]) -> Act:
    return lambda _ledger, _sid, handle: handle.record_trajectory(**{**GOOD, **overrides})


def _reward(value: Any, **info: Any) -> Act:
    return lambda _ledger, _sid, handle: handle.post_reward(value, **info)


async def _duplicate(ledger: Ledger, sid: str, _handle: Any) -> None:
    await ledger.create_session(sid, **{**KW, "uid": "other"})


def _setup_records(count: int, tokens: int) -> Act:
    async def setup(_ledger: Ledger, _sid: str, handle: Any) -> None:
        for _ in range(count):
            await handle.record_trajectory(prompt_ids=[1], response_ids=list(range(1, tokens + 1)))
    return setup


def _label(overrides: dict[str, Any]) -> str:
    key, value = next(iter(overrides.items()))
    return f"{key}={value!r:.24}"


CASES: list[Case] = [
    *(Case(f"identity-{field}-{_label(o)}", field, _create(o), session=False) for field, o in BAD_IDENTITIES),
    Case("identity-session_index=group_size", "session_index", _create({"session_index": 1, "group_size": 1}), session=False),
    Case("identity-partition=TRAIN", "partition", _create({"partition": "TRAIN"}), session=False),
    Case("identity-data_source-too-long", "data_source", _create({"data_source": "d" * 129}), session=False),
    Case("identity-runner-empty", "runner", _create({"runner": ""}), session=False),
    Case("identity-duplicate-session_id", "session_id", _duplicate, mentions=("already exists",)),
    *(Case(f"trajectory-{field}-{_label(o)}", field, _record(o)) for field, o in BAD_TRAJECTORIES),
    Case("trajectory-mask-0.5", "response_mask", _record({"response_mask": [0.5, 1]})),
    Case("trajectory-prompt-nan", "prompt_ids", _record({"prompt_ids": [float("nan"), 1.0]})),
    Case("trajectory-response-negative", "response_ids", _record({"response_ids": [-5, 3]})),
    Case("trajectory-response-huge-uint64", "response_ids", _record({"response_ids": np.array([2**63], dtype=np.uint64)})),
    *(Case(f"reward-{value!r}", "reward", _reward(value))
      for value in (float("nan"), float("inf"), -math.inf, "1.0", True, np.float32("nan"), [1.0])),
    Case("reward-info-nan", "info", _reward(1.0, acc=float("nan"))),
    Case("reward-info-not-json", "info", _reward(1.0, obj=object())),
    Case("complete-score-nan", "score", lambda _l, _s, h: h.complete(score=float("nan"))),
    Case("fail-unknown-reason", "reason", lambda _l, _s, h: h.fail("bad_luck")),
    # size caps (CAPS): per event, then per session
    Case("cap-event-trajectory-tokens", "trajectory", _record({"response_ids": list(range(1, 5001))}),
         mentions=("max_event_bytes=16,384", "TrajectoryRecorded", "token payload")),
    Case("cap-event-trajectory-extra", "trajectory", _record({"extra": {"blob": BLOB}}), mentions=("max_event_bytes=16,384",)),
    Case("cap-event-metadata", "metadata", _create({"metadata": {"blob": BLOB}}), session=False,
         mentions=("max_event_bytes=16,384", "SessionCreated")),
    Case("cap-event-reward-info", "info", _reward(1.0, blob=BLOB), mentions=("max_event_bytes=16,384", "RewardPosted")),
    Case("cap-session-events", "trajectory", _record({}), setup=_setup_records(6, 2),
         mentions=("max_session_events=8", "has 8 events")),
    Case("cap-session-events-reward", "info", _reward(0.5), setup=_setup_records(6, 2), mentions=("max_session_events=8",)),
    Case("cap-session-bytes", "trajectory", _record({"response_ids": list(range(1, 2501))}), setup=_setup_records(3, 2500),
         mentions=("max_session_bytes=49,152",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_input_is_refused_naming_the_field_and_nothing_is_written(ledger: Ledger, case: Case) -> None:
    sid = f"bad-{uuid.uuid4().hex[:10]}"
    handle = await ledger.create_session(sid, **KW) if case.session else None
    if case.setup is not None:
        await case.setup(ledger, sid, handle)
    position = await ledger.store.last_position()
    version = None if handle is None else handle.version
    with pytest.raises(InvalidInput) as caught:
        await case.act(ledger, sid, handle)
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.field == case.field, f"{case.id}: field {error.field!r}: {error}"
    message = str(error)
    assert message.startswith(f"session {error.session_id!r}: {case.field}:") if error.session_id else case.field in message
    for text_ in case.mentions:
        assert text_ in message, f"{case.id}: {text_!r} not in {message!r}"
    assert await ledger.store.last_position() == position, f"{case.id}: something was written"
    if handle is not None:
        assert handle.version == version and handle.state == "running"
        assert await ledger.store.stream_version(sid) == version
        if case.id.startswith("cap-"):
            assert error.limit_name in message and error.size > error.limit  # type: ignore[attr-defined]
        if case.id.startswith("cap-session"):
            assert await handle.complete() == "succeeded"  # a session at its cap can always end


async def test_a_cap_breach_inside_a_session_fails_it_as_invalid_output(ledger: Ledger) -> None:
    sid = f"capped-{uuid.uuid4().hex[:10]}"
    with pytest.raises(InvalidInput, match="max_event_bytes"):
        async with ledger.session(sid, **KW) as s:
            await s.record_trajectory(prompt_ids=[1], response_ids=list(range(1, 5001)))
    stored = await ledger.store.read_stream(sid)
    assert [e.type for e in stored] == ["SessionCreated", "SessionStarted", "SessionFailed", "PlaceholderEmitted"]
    assert stored[2].data["reason"] == "invalid_output" and "max_event_bytes" in stored[2].data["message"]


async def test_caps_count_what_is_already_stored_when_a_session_is_reloaded(ledger: Ledger) -> None:
    sid = f"reload-{uuid.uuid4().hex[:10]}"
    handle = await ledger.create_session(sid, **KW)
    await _setup_records(3, 2500)(ledger, sid, handle)
    reloaded = await ledger.load_session(sid)
    with pytest.raises(InvalidInput, match="max_session_bytes"):
        await reloaded.record_trajectory(prompt_ids=[1], response_ids=list(range(1, 2501)))
    await reloaded.fail("runner_error", message="gave up")  # terminal commands are never capped
    assert reloaded.state == "failed"


def test_cap_defaults_and_validation() -> None:
    assert Limits() == Limits(MAX_EVENT_BYTES, MAX_SESSION_EVENTS, MAX_SESSION_BYTES)
    assert (MAX_EVENT_BYTES, MAX_SESSION_EVENTS, MAX_SESSION_BYTES) == (8 * 2**20, 51_200, 128 * 2**20)
    Limits(None, None, None)  # no caps at all
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_event_bytes"):
            Limits(max_event_bytes=bad)  # type: ignore[arg-type]


async def test_ledger_open_validates_caps(sqlite_url: str) -> None:
    with pytest.raises(ValueError, match="max_session_events"):
        async with Ledger.open(sqlite_url, max_session_events=0):
            pass
    async with Ledger.open(sqlite_url, max_event_bytes=None) as ledger:
        assert ledger.limits.max_event_bytes is None and ledger.limits.max_session_events == MAX_SESSION_EVENTS


# ------------------------------------------------------------------------------ a damaged log
async def _two_sessions(ledger: Ledger) -> int:
    """`ok` (projected) then `hit` (not yet projected); returns the checkpoint after `ok`."""
    async with ledger.session("ok", **KW) as s:
        await s.record_trajectory(**GOOD)
        await s.post_reward(1.0)
    await ledger.project()
    checkpoint = await ledger.store.last_position()
    async with ledger.session("hit", **{**KW, "uid": "u2"}) as s:
        await s.record_trajectory(**GOOD)
        await s.post_reward(0.5)
    return checkpoint


async def _read_models(ledger: Ledger) -> Any:
    async with ledger.engine.connect() as conn:
        return [
            (await conn.execute(text(f"SELECT count(*) FROM {t}"))).scalar_one()
            for t in ("sessions", "groups", "queue_rows", "metric_counts")
        ] + [(await conn.execute(text("SELECT position FROM checkpoints"))).scalar_one()]


async def _projection_refuses(ledger: Ledger, error: type[Exception], *needles: str) -> None:
    before = await _read_models(ledger)
    with pytest.raises(error) as caught:
        await ledger.project()
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
    assert await _read_models(ledger) == before, "a failed page must write nothing"


async def test_malformed_json_in_a_stored_event(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        checkpoint = await _two_sessions(ledger)
        tamper = text("UPDATE events SET data = '{\"reward\": 0.5, ' WHERE session_id = 'hit' AND type = 'RewardPosted'")
        if ledger.engine.dialect.name == "postgresql":
            with pytest.raises(DBAPIError, match="json"):  # JSONB refuses it: the log cannot hold it
                async with ledger.engine.begin() as conn:
                    await conn.execute(tamper)
            assert (await audit(ledger.engine)).ok
            return
        async with ledger.engine.begin() as conn:
            await conn.execute(tamper)
        with pytest.raises(StoredJSONError, match="session 'hit': stored JSON is malformed") as caught:
            await ledger.load_session("hit")
        assert "rollout-ledger audit" in str(caught.value) and isinstance(caught.value, ValueError)
        await _projection_refuses(ledger, StoredJSONError, "stored JSON is malformed", '{"reward": 0.5, ')
        assert (await _read_models(ledger))[-1] == checkpoint
        report = await audit(ledger.engine)  # reported, not raised: see test_audit_reports_malformed_json
        assert [(d.session_id, d.field) for d in report.divergences] == [("hit", "data")]
        assert "stored JSON is malformed" in str(report.divergences[0].found)


async def test_audit_reports_malformed_json_as_a_divergence(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        await _two_sessions(ledger)
        async with ledger.engine.begin() as conn:
            await conn.execute(text("UPDATE events SET data = '{' WHERE session_id = 'hit' AND type = 'RewardPosted'"))
            position = (await conn.execute(text("SELECT position FROM events WHERE session_id = 'hit' AND type = 'RewardPosted'"))).scalar_one()
        report = await audit(ledger.engine)
        assert not report.ok and report.divergences[0].session_id == "hit"
        first = report.divergences[0]
        assert (first.field, first.position, first.expected) == ("data", position, "valid JSON")
        assert report.events == 10 and report.sessions == 2  # the whole log was still checked


async def _insert(ledger: Ledger, type_: str, schema_version: int, data: dict[str, Any]) -> int:
    async with ledger.engine.begin() as conn:
        result = await conn.execute(insert(events).values(
            event_id=str(uuid.uuid4()), session_id="hit", version=6, type=type_, schema_version=schema_version,
            run="default", uid="u2", partition="val", global_step=0, data=data, payload=None,
            recorded_at=datetime.now(timezone.utc),
        ))
        return int(result.inserted_primary_key[0])


@pytest.mark.parametrize(
    ("type_", "schema_version", "needles"),
    [
        ("SessionPaused", 1, ("unknown event type 'SessionPaused'", "upgrade")),
        ("RewardPosted", 7, ("'RewardPosted' has schema_version 7", "newer than this library's 1")),
    ],
    ids=["type-from-the-future", "schema-version-from-the-future"],
)
async def test_an_event_from_the_future_is_a_clear_error(db_url: str, type_: str, schema_version: int, needles: tuple[str, ...]) -> None:
    async with Ledger.open(db_url) as ledger:
        checkpoint = await _two_sessions(ledger)
        position = await _insert(ledger, type_, schema_version, {"note": "from a newer rollout-ledger"})
        with pytest.raises(UnknownEventError) as caught:
            await ledger.load_session("hit")
        for needle in needles:
            assert needle in str(caught.value)
        await _projection_refuses(ledger, UnknownEventError, *needles)
        assert (await _read_models(ledger))[-1] == checkpoint  # the page holding it is not projected
        report = await audit(ledger.engine)
        assert any(d.position == position and d.field == "type" and needles[0] in str(d.found) for d in report.divergences)
        # the rest of the log is intact
        cw.check_streams({sid: s for sid, s in (await cw.log_streams(ledger.engine)).items() if sid != "hit"})


async def _empty_reward_data(ledger: Ledger, session_id: str) -> int:
    """Replace a session's RewardPosted data with `{}` (valid JSON, wrong shape); its position."""
    async with ledger.engine.begin() as conn:
        where = (events.c.session_id == session_id, events.c.type == "RewardPosted")
        await conn.execute(update(events).where(*where).values(data={}))
        return (await conn.execute(select(events.c.position).where(*where))).scalar_one()


async def test_event_data_of_the_wrong_shape_names_its_position(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        checkpoint = await _two_sessions(ledger)
        position = await _empty_reward_data(ledger, "hit")
        needles = (f"event at position {position}", "RewardPosted", "malformed data")
        with pytest.raises(UnknownEventError) as caught:
            await ledger.load_session("hit")
        assert all(n in str(caught.value) for n in needles), str(caught.value)
        await _projection_refuses(ledger, UnknownEventError, *needles)
        assert (await _read_models(ledger))[-1] == checkpoint
        # within the projected part of the log, audit's replay reports it
        await _empty_reward_data(ledger, "ok")
        report = await audit(ledger.engine)
        assert not report.ok and "malformed data" in str(report.divergences[0])


async def test_audit_flags_data_of_the_wrong_shape_past_the_checkpoint(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        checkpoint = await _two_sessions(ledger)
        position = await _empty_reward_data(ledger, "hit")
        report = await audit(ledger.engine)
        assert position > checkpoint == report.projected_through
        assert [(d.session_id, d.position, d.field) for d in report.divergences] == [("hit", position, "data")]
        assert "malformed data" in str(report.divergences[0]) and "reward" in str(report.divergences[0])
