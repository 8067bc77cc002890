"""Schema evolution: TrajectoryRecorded v2 (`trainable_tokens`) and v3 (versions, `from_calls`), their
upcasters, golden v1 logs, and events this library cannot read (docs/design.md §4, §9)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sessions import Ledger, tokens
from sessions import events as ev
from sessions.errors import UnknownEventError
from store.log.records import NewEvent, StoredEvent
from tests import golden

V1 = golden.FIXTURES / "golden_v1.jsonl"
V2 = golden.FIXTURES / "golden_v2.jsonl"


def _raw(
    event_type: str, schema_version: int, data: dict[str, Any], payload: bytes | None = None
) -> StoredEvent:
    return StoredEvent(
        position=9,
        event_id="00000000-0000-0000-0000-000000000009",
        session_id="s-raw",
        version=3,
        type=event_type,
        schema_version=schema_version,
        run="r",
        uid="u",
        partition="train",
        global_step=0,
        data=data,
        payload=payload,
        recorded_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
    )


def _arrays(mask: list[int], *, logprobs: bool = False) -> tokens.TokenArrays:
    n = len(mask)
    return tokens.TokenArrays(
        np.arange(3, dtype="<i4"),
        np.arange(10, 10 + n, dtype="<i4"),
        np.array(mask, dtype=np.uint8),
        -np.ones(n, dtype="<f4") if logprobs else None,
    )


def _v1_data(prompt_len: int, response_len: int, has_logprobs: bool) -> dict[str, Any]:
    return {
        "index": 0,
        "num_turns": 2,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "has_logprobs": has_logprobs,
        "materialization_reason": None,
        "extra": {"k": 1},
    }


# ------------------------------------------------------------------ the v2 shape
def test_trajectory_recorded_is_schema_3_and_round_trips_trainable_tokens() -> None:
    assert ev.TrajectoryRecorded.SCHEMA_VERSION == 3
    arrays = _arrays([1, 0, 0, 1, 1], logprobs=True)
    event = ev.TrajectoryRecorded(
        index=1,
        num_turns=3,
        prompt_len=3,
        response_len=5,
        has_logprobs=True,
        trainable_tokens=3,
        extra={"tool": "sh"},
        min_version=2,
        max_version=4,
        from_calls=["c1", "c2"],
        payload=tokens.encode(arrays),
    )
    data = event.to_data()
    assert data["trainable_tokens"] == 3 and "payload" not in data
    assert ev.TrajectoryRecorded.from_data(data, event.payload) == event
    new = ev.envelope(
        event, session_id="s", version=3, run="r", uid="u", partition="val", global_step=0
    )
    assert new.schema_version == 3
    back = ev.decode(_raw("TrajectoryRecorded", new.schema_version, new.data, new.payload)).event
    assert back == event
    # Only changed shapes are bumped (the golden logs' record of them).
    assert {
        name: cls.SCHEMA_VERSION for name, cls in ev.EVENT_TYPES.items() if cls.SCHEMA_VERSION > 1
    } == golden.LOG_SCHEMAS


async def test_the_recorder_counts_trainable_tokens(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        handle = await ledger.create_session(
            "s-t", uid="u", session_index=0, group_size=1, partition="train", global_step=0
        )
        await handle.record_trajectory(
            prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], response_mask=[1, 0, 1, 1]
        )
        await handle.record_trajectory(
            prompt_ids=[1], response_ids=[3, 4]
        )  # default mask: all trainable
        stored = [
            s for s in await ledger.store.read_stream("s-t") if s.type == "TrajectoryRecorded"
        ]
    assert [(s.schema_version, s.data["trainable_tokens"]) for s in stored] == [(3, 3), (3, 2)]


# ------------------------------------------------------------------ the upcaster
#: What the v2 -> v3 upcaster adds: a trajectory handed over whole, its versions unknown.
_V3_FIELDS = {"min_version": None, "max_version": None, "from_calls": []}


def test_v1_trajectory_upcasts_to_v2_counting_the_payload_mask() -> None:
    mask = [0, 1, 1, 0, 1, 1]
    for has_logprobs in (False, True):
        payload = tokens.encode(_arrays(mask, logprobs=has_logprobs))
        data = _v1_data(3, len(mask), has_logprobs)
        stored = _raw("TrajectoryRecorded", 1, data, payload)
        event = ev.decode(stored).event
        assert isinstance(event, ev.TrajectoryRecorded)
        assert event.trainable_tokens == 4
        assert event.to_data() == {**data, "trainable_tokens": 4, **_V3_FIELDS}
        assert stored.data == data and "trainable_tokens" not in stored.data, (
            "upcasting must not mutate stored data"
        )
        assert event.arrays().response_mask.tolist() == mask


def test_v1_upcast_without_the_payload_means_unknown() -> None:
    """Readers that skip payloads (the projector's pages) get None, never a guess."""
    data = _v1_data(3, 4, False)
    assert ev.upcast("TrajectoryRecorded", 1, data)["trainable_tokens"] is None
    truncated = tokens.encode(_arrays([1, 1, 0, 1]))[:-2]
    assert ev.upcast("TrajectoryRecorded", 1, data, truncated)["trainable_tokens"] is None
    assert ev.upcast("TrajectoryRecorded", 2, {**data, "trainable_tokens": 7}) == {
        **data,
        "trainable_tokens": 7,
        **_V3_FIELDS,
    }


def test_the_v1_upcaster_is_registered_with_payload_access() -> None:
    assert ("TrajectoryRecorded", 1) in ev.UPCASTERS
    assert (
        ev.upcast("TrajectoryRecorded", 1, _v1_data(3, 2, False), tokens.encode(_arrays([1, 0])))[
            "trainable_tokens"
        ]
        == 1
    )


def test_payload_upcasters_chain_with_data_only_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data-only v3 -> v4 step after the payload-aware v1 -> v2 one (a future bump)."""
    monkeypatch.setattr(ev, "UPCASTERS", dict(ev.UPCASTERS))
    monkeypatch.setattr(ev.TrajectoryRecorded, "SCHEMA_VERSION", 4)

    @ev.upcaster("TrajectoryRecorded", 3)
    def three_to_four(data: dict[str, Any]) -> dict[str, Any]:
        data["extra"] = {**data["extra"], "lifted": True}
        return data

    event = ev.decode(
        _raw("TrajectoryRecorded", 1, _v1_data(3, 3, False), tokens.encode(_arrays([1, 1, 0])))
    ).event
    assert event.trainable_tokens == 2 and event.extra == {"k": 1, "lifted": True}


# ------------------------------------------------------------------ golden logs across versions
def test_golden_v1_log_is_schema_1_and_v2_log_is_schema_2() -> None:
    v1, v2 = golden.stored_events(V1), golden.stored_events(V2)
    assert {s.schema_version for s in v1 if s.type == "TrajectoryRecorded"} == {1}
    assert all("trainable_tokens" not in s.data for s in v1)
    assert {s.schema_version for s in v2 if s.type == "TrajectoryRecorded"} == {2}
    assert len({s.type for s in v1}) == 8, "the golden log holds every event type of its time"
    newest = golden.stored_events(golden.golden_logs()[-1])
    # PayloadsPruned is newer than golden_v3; the golden scenario does not
    # prune yet, so the next golden log (v4, tests/fixtures/make_golden.py) must add a prune.
    not_yet_golden = {"PayloadsPruned"}
    assert {s.type for s in newest} == set(ev.EVENT_TYPES) - not_yet_golden, (
        "the newest golden log holds every event type"
    )


def test_decoding_the_v1_golden_log_yields_the_v2_events() -> None:
    """Same scenario, recorded before and after the bump: v1 upcast == v2 as written today."""
    v1, v2 = golden.stored_events(V1), golden.stored_events(V2)
    assert [(s.position, s.session_id, s.version, s.type) for s in v1] == [
        (s.position, s.session_id, s.version, s.type) for s in v2
    ]
    trajectories = 0
    for old, new in zip(v1, v2):
        lifted, current = ev.decode(old), ev.decode(new)
        assert lifted == current, f"position {old.position}"
        if isinstance(lifted.event, ev.TrajectoryRecorded):
            trajectories += 1
            assert lifted.event.trainable_tokens == int(lifted.event.arrays().response_mask.sum())
            assert 0 < lifted.event.trainable_tokens <= lifted.event.response_len
    assert trajectories >= 8


def _make_golden_module() -> Any:
    spec = importlib.util.spec_from_file_location("make_golden", golden.FIXTURES / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_newest_golden_log_is_what_todays_recorder_writes(tmp_path: Path) -> None:
    """A change of event shape without a schema bump (and a new golden log) fails here."""
    make_golden = _make_golden_module()
    newest = golden.golden_logs()[-1]
    assert newest.name == f"golden_v{golden.LOG_VERSION}.jsonl"
    assert {
        name: cls.SCHEMA_VERSION for name, cls in ev.EVENT_TYPES.items() if cls.SCHEMA_VERSION > 1
    } == golden.LOG_SCHEMAS, (
        "an event's schema changed: record a new golden log (tests/fixtures/make_golden.py log) and bump LOG_VERSION"
    )
    async with Ledger.open(
        f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
        run=make_golden.RUN,
        placeholder_policy=make_golden.POLICY,
        circuit_breaker=make_golden.BREAKER,
    ) as ledger:
        await make_golden.record_scenario(ledger)
        rows = make_golden.normalise(await golden.dump_rows(ledger.engine))
    # The slot columns (revision 0004) are the store's copy of a creation's data, not event shape:
    # a log written before them has them NULL. Check them against the data, then compare the rest.
    for row in rows:
        expected_slot = (
            (row["data"]["session_index"], row["data"]["group_size"])
            if row["type"] == "SessionCreated"
            else (None, None)
        )
        assert tuple(row[name] for name in golden.ADDED_LATER) == expected_slot, row["position"]
    today = [golden.to_line({**r, **dict.fromkeys(golden.ADDED_LATER)}) for r in rows]
    stored = [
        golden.to_line({**golden.from_line(line), **dict.fromkeys(golden.ADDED_LATER)})
        for line in newest.read_text(encoding="utf-8").splitlines()
    ]
    for line, (got, want) in enumerate(zip(today, stored), start=1):
        assert got == want, (
            f"{newest.name} line {line}: today's recorder writes a different event. A change of event shape needs a "
            f"SCHEMA_VERSION bump, an upcaster and a new golden log (tests/fixtures/make_golden.py log).\n"
            f"golden: {want[:300]}\ntoday:  {got[:300]}"
        )
    assert len(today) == len(stored)


# ------------------------------------------------------------------ unreadable events
@pytest.mark.parametrize(
    ("event_type", "schema_version", "data"),
    [
        ("SessionTeleported", 3, {"where": "mars"}),  # unknown type
        ("TrajectoryRecorded", 0, _v1_data(1, 1, False)),  # a version with no upcaster
        ("TrajectoryRecorded", 7, _v1_data(1, 1, False)),  # a version from the future
        ("TrajectoryRecorded", 1, {"index": 0}),  # v1 data the upcaster cannot lift
    ],
    ids=["unknown-type", "no-upcaster", "future-version", "malformed-v1"],
)
def test_unreadable_events_raise_unknown_event_error_naming_type_and_version(
    event_type: str, schema_version: int, data: dict[str, Any]
) -> None:
    with pytest.raises(UnknownEventError) as info:
        ev.decode(_raw(event_type, schema_version, data))
    message = str(info.value)
    assert event_type in message and f"schema_version {schema_version}" in message
    assert "\n" not in message


async def _append_raw(
    ledger: Ledger, session_id: str, event_type: str, schema_version: int, data: dict[str, Any]
) -> None:
    version = await ledger.store.stream_version(session_id)
    await ledger.store.append(
        session_id,
        version,
        [
            NewEvent(
                event_id=f"00000000-0000-0000-0000-{version + 1:012d}",
                session_id=session_id,
                version=version + 1,
                type=event_type,
                schema_version=schema_version,
                run="default",
                uid="u",
                partition="val",
                global_step=0,
                data=data,
                payload=None,
                recorded_at=datetime.now(timezone.utc),
            )
        ],
    )


@pytest.mark.parametrize(
    ("event_type", "schema_version"), [("SessionTeleported", 3), ("TrajectoryRecorded", 0)]
)
async def test_load_session_refuses_a_stream_it_cannot_read(
    db_url: str, event_type: str, schema_version: int
) -> None:
    async with Ledger.open(db_url) as ledger:
        await ledger.create_session(
            "s-odd", uid="u", session_index=0, group_size=1, partition="val", global_step=0
        )
        await _append_raw(ledger, "s-odd", event_type, schema_version, _v1_data(1, 1, False))
        with pytest.raises(UnknownEventError) as info:
            await ledger.load_session("s-odd")
    assert event_type in str(info.value) and f"schema_version {schema_version}" in str(info.value)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_names_an_unknown_type_and_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    from sessions.cli.main import main

    db = tmp_path / "odd.db"

    async def record() -> None:
        async with Ledger.open(str(db)) as ledger:
            handle = await ledger.create_session(
                "s-ok", uid="u1", session_index=0, group_size=1, partition="val", global_step=0
            )
            await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
            await handle.complete()
            await ledger.project()
            await ledger.create_session(
                "s-odd", uid="u2", session_index=0, group_size=1, partition="val", global_step=0
            )
            await _append_raw(ledger, "s-odd", "SessionTeleported", 3, {"where": "mars"})

    asyncio.run(record())
    # audit, as a user runs it: the console script in a subprocess
    result = _cli("audit", "--db", str(db), cwd=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert (
        "SessionTeleported" in lines[0] and "schema_version 3" in lines[0] and "s-odd" in lines[0]
    )
    # history of that stream fails the same way: one line, no traceback (in-process CLI)
    capsys.readouterr()
    assert main(["history", "s-odd", "--db", str(db)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SessionTeleported" in err[0] and "schema_version 3" in err[0], err
    # project no longer stops at it (docs/design.md §7): it quarantines the event and names it, exit 0
    assert main(["project", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    named = [line for line in out.splitlines() if "SessionTeleported" in line]
    assert len(named) == 1 and "schema_version 3" in named[0] and "s-odd" in named[0], out
    assert "quarantined" in out
    # ... and audit still reports it after the projection
    result = _cli("audit", "--db", str(db), cwd=tmp_path)
    assert result.returncode != 0 and "SessionTeleported" in result.stderr, result.stderr


def test_upcaster_registry_is_not_left_patched() -> None:
    assert ev.TrajectoryRecorded.SCHEMA_VERSION == 3
    assert ("TrajectoryRecorded", 3) not in ev.UPCASTERS
    assert dataclasses.fields(ev.TrajectoryRecorded)
