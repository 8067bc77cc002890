"""Events and token payloads: binary layout, JSON round trips, unknown types, upcasters (docs/design.md §4)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions import aggregate as agg
from sessions import events as ev
from sessions import storable, tokens
from sessions.errors import InvalidInput, UnknownEventError
from store.log.records import StoredEvent, encode_data


def stored_from(new: Any, position: int = 1) -> StoredEvent:
    """What the store would hand back for a NewEvent (the JSON column round-trips plain data)."""
    return StoredEvent(
        position=position,
        event_id=new.event_id,
        session_id=new.session_id,
        version=new.version,
        type=new.type,
        schema_version=new.schema_version,
        run=new.run,
        uid=new.uid,
        partition=new.partition,
        global_step=new.global_step,
        data=new.data,
        payload=new.payload,
        recorded_at=new.recorded_at,
    )


def raw(
    event_type: str, schema_version: int, data: dict[str, Any], payload: bytes | None = None
) -> StoredEvent:
    return StoredEvent(
        position=7,
        event_id="00000000-0000-0000-0000-000000000007",
        session_id="s-raw",
        version=1,
        type=event_type,
        schema_version=schema_version,
        run="default",
        uid="u",
        partition="val",
        global_step=0,
        data=data,
        payload=payload,
        recorded_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
    )


# ------------------------------------------------------------------ token payloads
def test_payload_layout_is_little_endian_int32_then_float32_then_mask() -> None:
    arrays = tokens.TokenArrays(
        prompt_ids=np.array(
            [1, 258, 2**31 - 1], dtype=">i4"
        ),  # big-endian input must still be stored LE
        response_ids=np.array([7, 65536], dtype=np.int64),
        response_mask=np.array([1, 0], dtype=np.uint8),
        logprobs=np.array([-0.5, -1.25], dtype=np.float64),
    )
    payload = tokens.encode(arrays)
    expected = (
        struct.pack("<3i", 1, 258, 2**31 - 1)
        + struct.pack("<2i", 7, 65536)
        + struct.pack("<2f", -0.5, -1.25)
        + bytes([1, 0])
    )
    assert payload == expected
    assert len(payload) == tokens.payload_size(3, 2, True)


def test_payload_without_logprobs_has_no_logprob_section() -> None:
    arrays = tokens.TokenArrays(
        np.array([5], dtype=np.int32),
        np.array([6, 7], dtype=np.int32),
        np.array([0, 1], dtype=np.uint8),
        None,
    )
    payload = tokens.encode(arrays)
    assert payload == struct.pack("<3i", 5, 6, 7) + bytes([0, 1])
    back = tokens.decode(payload, 1, 2, False)
    assert back.logprobs is None
    assert back.prompt_ids.tolist() == [5] and back.response_ids.tolist() == [6, 7]
    assert back.response_mask.tolist() == [0, 1]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40),
    data=st.data(),
)
def test_payload_round_trip(prompt: list[int], data: st.DataObject) -> None:
    response = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40))
    n = len(response)
    mask = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    with_logprobs = data.draw(st.booleans())
    logprobs = (
        data.draw(st.lists(st.floats(-100, 0, width=32, allow_nan=False), min_size=n, max_size=n))
        if with_logprobs
        else None
    )
    arrays = tokens.TokenArrays(
        np.array(prompt, dtype=np.int64),
        np.array(response, dtype=np.int64),
        np.array(mask, dtype=np.uint8),
        None if logprobs is None else np.array(logprobs, dtype=np.float32),
    )
    payload = tokens.encode(arrays)
    assert len(payload) == tokens.payload_size(len(prompt), n, with_logprobs)
    back = tokens.decode(payload, len(prompt), n, with_logprobs)
    assert back.prompt_ids.dtype == np.dtype("<i4") and back.response_ids.dtype == np.dtype("<i4")
    assert back.prompt_ids.tolist() == prompt
    assert back.response_ids.tolist() == response
    assert back.response_mask.tolist() == mask
    if logprobs is None:
        assert back.logprobs is None
    else:
        assert back.logprobs is not None and back.logprobs.dtype == np.dtype("<f4")
        assert back.logprobs.tolist() == logprobs  # exact: float32 in, float32 out


def test_decode_rejects_a_payload_of_the_wrong_size() -> None:
    arrays = tokens.TokenArrays(np.array([1, 2]), np.array([3]), np.array([1]), None)
    payload = tokens.encode(arrays)
    with pytest.raises(ValueError, match="bytes"):
        tokens.decode(payload, 2, 1, True)
    with pytest.raises(ValueError):
        tokens.decode(payload[:-1], 2, 1, False)


# ------------------------------------------------------------------ event JSON round trips
def _sample_events() -> list[ev.Event]:
    arrays = tokens.TokenArrays(
        np.array([11, 12, 13]),
        np.array([21, 22]),
        np.array([1, 0], dtype=np.uint8),
        np.array([-0.1, -0.2]),
    )
    return [
        ev.SessionCreated(
            run="r1",
            uid="u1",
            session_index=2,
            group_size=4,
            partition="train",
            global_step=9,
            data_source="gsm8k",
            runner="sim",
            sample_index=3,
            metadata={"k": [1, 2], "nested": {"a": None}},
        ),
        ev.SessionCreated(
            run="r1", uid="u1", session_index=0, group_size=1, partition="val", global_step=None
        ),
        ev.SessionStarted(attempt=2, timeout_s=1.5),
        ev.SessionStarted(),
        ev.TrajectoryRecorded(
            index=0,
            num_turns=3,
            prompt_len=3,
            response_len=2,
            has_logprobs=True,
            materialization_reason="final",
            extra={"tool_calls": 2},
            payload=tokens.encode(arrays),
        ),
        ev.RewardPosted(reward=0.75, info={"acc": 1.0, "lang": "py"}),
        ev.RewardPosted(reward=None, info={}),
        ev.SessionSucceeded(
            selected=[0, 1], trajectory_selection="all", score=0.75, score_source="reward_info"
        ),
        ev.SessionSucceeded(
            selected=[1], trajectory_selection="longest", score=None, score_source="absent"
        ),
        ev.SessionFailed(
            reason="timeout",
            error_type="TimeoutError",
            message="too slow",
            discarded_trajectories=1,
        ),
        ev.SessionFailed(
            reason="sandbox_error",
            error_type=None,
            message="",
            discarded_trajectories=0,
            placeholder="drop",
        ),
        ev.PlaceholderEmitted(
            reason="timeout", token_id=5, reward_info={"acc": 0.0, "reward": 0.0, "finished": False}
        ),
        ev.SessionCancelled(message="shutdown"),
        ev.SessionCancelled(),
    ]


@pytest.mark.parametrize("event", _sample_events(), ids=lambda e: e.TYPE)
def test_event_round_trips_through_an_envelope(event: ev.Event) -> None:
    new = ev.envelope(
        event, session_id="s-1", version=3, run="r1", uid="u1", partition="train", global_step=9
    )
    assert new.type == event.TYPE and new.schema_version == event.SCHEMA_VERSION
    assert new.recorded_at.tzinfo is not None and new.recorded_at.utcoffset().total_seconds() == 0
    import json

    json.dumps(new.data, allow_nan=False)  # the data column is plain JSON
    if isinstance(event, ev.TrajectoryRecorded):
        assert "payload" not in new.data and new.payload == event.payload
    else:
        assert new.payload is None
    back = ev.decode(stored_from(new, position=42))
    assert back.event == event
    assert (back.event_id, back.session_id, back.version, back.position) == (
        new.event_id,
        "s-1",
        3,
        42,
    )
    assert back.type == event.TYPE


def test_envelopes_get_fresh_event_ids() -> None:
    event = ev.SessionStarted()
    ids = {
        ev.envelope(
            event, session_id="s", version=1, run="r", uid="u", partition="val", global_step=0
        ).event_id
        for _ in range(50)
    }
    assert len(ids) == 50


def test_event_registry_covers_every_event_of_the_design() -> None:
    assert set(ev.EVENT_TYPES) == {
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "RewardPosted",
        "SessionSucceeded",
        "SessionFailed",
        "PlaceholderEmitted",
        "SessionCancelled",
        "AttemptFailed",
        "RunConfigured",  # retries and run fingerprints (issue 16)
        "PayloadsPruned",  # retention (issue 28)
        "ModelCallStarted",  # a model call's intent, its record or its failure (design §15)
        "ModelCallRecorded",
        "ModelCallFailed",
        "RunLaunched",  # a run's launches and resumes (issue 39)
        "BreakerTripped",  # the run's circuit breaker halted it (issue 43)
    }
    for name, cls in ev.EVENT_TYPES.items():
        assert cls.TYPE == name


def test_trajectory_arrays_decode_lazily_from_the_payload() -> None:
    arrays = tokens.TokenArrays(np.array([1, 2, 3]), np.array([4, 5]), np.array([0, 1]), None)
    event = ev.TrajectoryRecorded(
        index=0,
        num_turns=1,
        prompt_len=3,
        response_len=2,
        has_logprobs=False,
        payload=tokens.encode(arrays),
    )
    new = ev.envelope(
        event, session_id="s", version=3, run="r", uid="u", partition="val", global_step=1
    )
    back = ev.decode(stored_from(new)).event
    assert isinstance(back, ev.TrajectoryRecorded)
    got = back.arrays()
    assert got.prompt_ids.tolist() == [1, 2, 3]
    assert got.response_ids.tolist() == [4, 5]
    assert got.response_mask.tolist() == [0, 1]


# ------------------------------------------------------------------ unknown types and versions
def test_unknown_event_type_is_an_error_naming_type_and_version() -> None:
    with pytest.raises(UnknownEventError) as info:
        ev.decode(raw("SessionTeleported", 3, {"where": "mars"}))
    message = str(info.value)
    assert "SessionTeleported" in message and "3" in message


def test_schema_version_from_the_future_is_an_error_naming_type_and_version() -> None:
    future = ev.SessionStarted.SCHEMA_VERSION + 41
    with pytest.raises(UnknownEventError) as info:
        ev.decode(raw("SessionStarted", future, {"attempt": 1}))
    message = str(info.value)
    assert "SessionStarted" in message and str(future) in message


def test_malformed_event_data_is_an_error_not_a_crash() -> None:
    with pytest.raises(UnknownEventError, match="RewardPosted"):
        ev.decode(raw("RewardPosted", 1, {"info": {}}))  # `reward` is required


def test_unknown_event_error_is_a_store_error() -> None:
    from store.errors import StoreError

    assert issubclass(UnknownEventError, StoreError)


# ------------------------------------------------------------------ upcasters
def test_upcaster_lifts_old_data_of_a_real_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend SessionStarted v2 replaced v1's `timeout_ms` by `timeout_s`: old logs must still fold."""
    monkeypatch.setattr(ev, "UPCASTERS", dict(ev.UPCASTERS))
    monkeypatch.setattr(ev.SessionStarted, "SCHEMA_VERSION", 2)
    calls: list[dict[str, Any]] = []

    @ev.upcaster("SessionStarted", 1)
    def v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
        calls.append(dict(data))
        ms = data.pop("timeout_ms", None)
        data["timeout_s"] = None if ms is None else ms / 1000
        return data

    assert ev.UPCASTERS[("SessionStarted", 1)] is v1_to_v2
    old = raw("SessionStarted", 1, {"attempt": 2, "timeout_ms": 1500})
    back = ev.decode(old)
    assert back.event == ev.SessionStarted(attempt=2, timeout_s=1.5)
    assert calls == [{"attempt": 2, "timeout_ms": 1500}]
    assert old.data == {"attempt": 2, "timeout_ms": 1500}, (
        "upcasting must not mutate the stored data"
    )
    # Current-version events are not upcast.
    assert ev.decode(
        raw("SessionStarted", 2, {"attempt": 3, "timeout_s": 0.5})
    ).event == ev.SessionStarted(attempt=3, timeout_s=0.5)
    assert len(calls) == 1


@dataclass(frozen=True, slots=True, kw_only=True)
class _Renamed(ev.Event):
    TYPE: ClassVar[str] = "TestOnlyRenamed"
    SCHEMA_VERSION: ClassVar[int] = 3
    label: str
    count: int


def test_upcasters_chain_across_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ev, "UPCASTERS", dict(ev.UPCASTERS))
    monkeypatch.setitem(ev.EVENT_TYPES, _Renamed.TYPE, _Renamed)

    @ev.upcaster(_Renamed.TYPE, 1)
    def one_to_two(data: dict[str, Any]) -> dict[str, Any]:
        return {"label": data["name"], "n": data["n"]}

    @ev.upcaster(_Renamed.TYPE, 2)
    def two_to_three(data: dict[str, Any]) -> dict[str, Any]:
        return {"label": data["label"], "count": int(data["n"]) * 10}

    assert ev.decode(raw(_Renamed.TYPE, 1, {"name": "x", "n": 2})).event == _Renamed(
        label="x", count=20
    )
    assert ev.decode(raw(_Renamed.TYPE, 2, {"label": "y", "n": 3})).event == _Renamed(
        label="y", count=30
    )
    assert ev.decode(raw(_Renamed.TYPE, 3, {"label": "z", "count": 4})).event == _Renamed(
        label="z", count=4
    )


def test_missing_upcaster_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ev, "UPCASTERS", dict(ev.UPCASTERS))
    monkeypatch.setitem(ev.EVENT_TYPES, _Renamed.TYPE, _Renamed)

    @ev.upcaster(_Renamed.TYPE, 2)
    def two_to_three(data: dict[str, Any]) -> dict[str, Any]:
        return {"label": data["label"], "count": 0}

    with pytest.raises(UnknownEventError) as info:
        ev.decode(raw(_Renamed.TYPE, 1, {"name": "x", "n": 2}))
    assert _Renamed.TYPE in str(info.value) and "1" in str(info.value)


def test_test_registrations_do_not_leak() -> None:
    # Runs after the tests above (file order): monkeypatch must have restored the registries.
    assert _Renamed.TYPE not in ev.EVENT_TYPES
    assert ("SessionStarted", 1) not in ev.UPCASTERS
    assert ev.SessionStarted.SCHEMA_VERSION == 1


# ------------------------------------------------------------------ through the real store
async def test_events_and_tokens_round_trip_through_the_store(ledger) -> None:
    handle = await ledger.create_session(
        "s-tokens",
        uid="u1",
        session_index=0,
        group_size=2,
        partition="train",
        global_step=3,
        data_source="ds",
        metadata={"temperature": 0.7},
    )
    prompt = [0, 1, 2**31 - 1, 151643]
    response = [42, 43, 44]
    logprobs = np.array([-0.25, -1.5, -3.0], dtype=np.float32)
    await handle.record_trajectory(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=[1, 0, 1],
        response_logprobs=logprobs,
        num_turns=2,
        extra={"tool": "python"},
    )
    await handle.post_reward(0.5, acc=1.0)
    await handle.complete()

    stored = await ledger.store.read_stream("s-tokens")
    assert [s.type for s in stored] == [
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "RewardPosted",
        "SessionSucceeded",
    ]
    assert all(
        s.run == "default" and s.uid == "u1" and s.partition == "train" and s.global_step == 3
        for s in stored
    )
    trajectory = stored[2]
    assert isinstance(trajectory.payload, bytes)
    assert trajectory.payload[: 4 * len(prompt)] == struct.pack(f"<{len(prompt)}i", *prompt)
    assert all(s.payload is None for s in stored if s.type != "TrajectoryRecorded")
    decoded = [ev.decode(s) for s in stored]
    event = decoded[2].event
    assert isinstance(event, ev.TrajectoryRecorded)
    arrays = event.arrays()
    assert arrays.prompt_ids.tolist() == prompt
    assert arrays.response_ids.tolist() == response
    assert arrays.response_mask.tolist() == [1, 0, 1]
    assert arrays.logprobs is not None and arrays.logprobs.tolist() == logprobs.tolist()
    assert event.extra == {"tool": "python"} and event.num_turns == 2
    created = decoded[0].event
    assert isinstance(created, ev.SessionCreated) and created.metadata == {"temperature": 0.7}
    assert all(
        d.recorded_at.utcoffset() is not None and d.recorded_at.utcoffset().total_seconds() == 0
        for d in decoded
    )
    assert agg.fold("s-tokens", (d.event for d in decoded)) == handle.view
    assert dataclasses.asdict(handle.view)["trajectories"] == [
        {"index": 0, "num_turns": 2, "prompt_len": 4, "response_len": 3}
    ]


def test_event_ids_are_distinct_version_7_uuids_that_begin_with_the_clock() -> None:
    """Time-ordered ids keep the event-id index's inserts at its right edge: each id's
    first 48 bits are the milliseconds when it was made, so ids sort in the order they were made
    (to the millisecond), and the random rest keeps them distinct across several OS reads."""
    before = time.time_ns() // 1_000_000
    ids = []
    for _ in range(3 * 256 + 7):  # across several reads from the OS
        ids.append(ev.new_event_id())
        if len(ids) % 200 == 0:
            time.sleep(0.002)  # let the clock move within the run
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == len(ids)
    stamps = []
    for event_id in ids:
        parsed = uuid.UUID(event_id)
        assert str(parsed) == event_id and parsed.version == 7 and parsed.variant == uuid.RFC_4122
        stamps.append(parsed.int >> 80)
    assert before <= stamps[0] and stamps[-1] <= after
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_reuses_its_parents_unused_event_ids() -> None:
    ev.new_event_id()  # the parent now holds unused ids read ahead
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the ids it would use, then leave without cleanup
        os.close(read)
        os.write(write, " ".join(ev.new_event_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {ev.new_event_id() for _ in range(300)}  # more than were read ahead
    assert len(child) == 8 and not child & parent


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(data=st.dictionaries(st.text(max_size=8), _JSON_VALUES, max_size=6))
@settings(max_examples=300, deadline=None)
def test_event_data_is_stored_as_json_that_reads_back_as_the_stdlibs_would(
    data: dict[str, Any],
) -> None:
    """`encode_data` (orjson, the stdlib for what orjson refuses: integers beyond 64 bits, lone
    surrogates) writes text that decodes to what `json.dumps`' text decodes to."""
    assert json.loads(encode_data(data)) == json.loads(json.dumps(data))


def test_event_data_the_fast_encoder_refuses_is_still_encoded() -> None:
    for data in ({"big": 2**64}, {"small": -(2**63) - 1}, {"lone": "\ud800"}, {1: "int key"}):
        assert json.loads(encode_data(data)) == json.loads(json.dumps(data))


_TEXT = st.text(alphabet=st.sampled_from(["a", "é", "\x00", "\ud800", " "]), max_size=6)


@given(
    reward=st.one_of(
        st.none(),
        st.floats(-1, 1),
        st.floats(-1, 1).map(np.float64),
        st.integers(-3, 3).map(np.int64),
    ),
    info=st.dictionaries(
        _TEXT, st.one_of(_TEXT, st.integers(-5, 5), st.integers(-5, 5).map(np.int32)), max_size=3
    ),
)
@settings(max_examples=200, deadline=None)
def test_the_data_clean_event_hands_the_envelope_is_the_cleaned_events_own(
    reward: Any, info: dict[str, Any]
) -> None:
    """`clean_event_data` returns the data its check built, which the recorder's envelope stores
    instead of building it again: it must be the returned event's `to_data()`, on the fast path
    and on the cleaning one (numpy scalars, NUL and lone surrogates in free text) alike."""
    try:
        cleaned, data = storable.clean_event_data("s-1", ev.RewardPosted(reward=reward, info=info))
    except InvalidInput:
        return
    assert (
        data == cleaned.to_data()
        and storable.clean_event("s-1", ev.RewardPosted(reward=reward, info=info)) == cleaned
    )
