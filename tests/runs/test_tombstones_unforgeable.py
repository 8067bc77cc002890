"""Issue 40, case 1: a tombstone is known by its row's `pruned_by`, never by its bytes.

Token ids whose int32 bytes spell the 64-byte tombstone layout (magic prefix, a prune id, a
length, a digest) are a trajectory like any other: accepted, audited clean, prunable, and left
alone by revision 0008's migration of old logs, which converts only the tombstones a recorded
prune wrote. Both backends; hypothesis draws the spelling.
"""

from __future__ import annotations

import asyncio
import struct
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from sessions import Ledger, StepPrunedError, prune
from sessions import tokens as tk
from sessions.audit.auditing import audit
from sessions.runs import pruning, retention
from store import create_engine, upgrade
from store.schema.migrate import alembic_config
from tests.conftest import wipe

#: The tombstone prefix prunes before revision 0008 were recognised by (and still write).
OLD_MAGIC = b"\x00RLPRUN\x01"
#: (prompt_len, response_len) whose payload (4 bytes an id, 1 a mask byte) is exactly 64 bytes.
SIXTY_FOUR = [(1, 12), (6, 8), (11, 4)]


@st.composite
def ids_spelling_a_tombstone(draw: Any) -> tuple[list[int], list[int], list[int]]:
    """prompt ids, response ids and mask whose payload bytes are a well-formed old tombstone."""
    prompt_len, response_len = draw(st.sampled_from(SIXTY_FOUR))
    raw = bytearray(
        OLD_MAGIC
        + draw(st.uuids()).bytes
        + struct.pack("<Q", draw(st.integers(0, 2**40)))
        + draw(st.binary(min_size=32, max_size=32))
    )
    mask = draw(st.lists(st.integers(0, 1), min_size=response_len, max_size=response_len))
    raw[64 - response_len :] = bytes(mask)  # the payload ends with the mask, a byte a token
    ids = raw[: 64 - response_len]
    for high in range(3, len(ids), 4):  # token ids are in [0, 2**31): clear each sign bit
        ids[high] &= 0x7F
    values = list(struct.unpack(f"<{len(ids) // 4}i", bytes(ids)))
    return values[:prompt_len], values[prompt_len:], mask


def _payload(prompt: list[int], response: list[int], mask: list[int]) -> bytes:
    return tk.encode(
        tk.TokenArrays(
            tk.np.asarray(prompt, dtype=tk.INT32),
            tk.np.asarray(response, dtype=tk.INT32),
            tk.np.asarray(mask, dtype="u1"),
            None,
        )
    )


async def _session(ledger: Ledger, sid: str, step: int, ids: tuple[Any, ...] | None = None) -> None:
    prompt, response, mask = ids or ([1, 2], [3, 4], [1, 1])
    handle = await ledger.create_session(
        sid,
        uid=sid.replace("_", "-"),
        session_index=0,
        group_size=1,
        partition="train",
        global_step=step,
    )
    await handle.record_trajectory(prompt_ids=prompt, response_ids=response, response_mask=mask)
    await handle.complete(score=1.0)


async def _marked(ledger: Ledger) -> dict[int, str]:
    async with ledger.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT position, pruned_by FROM events WHERE pruned_by IS NOT NULL")
        )
        return {int(p): str(b) for p, b in rows}


async def _payload_at(ledger: Ledger, sid: str) -> bytes:
    async with ledger.engine.connect() as conn:
        return bytes(
            (
                await conn.execute(
                    text(
                        "SELECT payload FROM events WHERE session_id = :s "
                        "AND type = 'TrajectoryRecorded'"
                    ),
                    {"s": sid},
                )
            ).scalar_one()
        )


async def _spelled(url: str, spelled: tuple[list[int], list[int], list[int]]) -> None:
    # The strategy really spells what the old code took for a tombstone.
    assert retention.read_tombstone(_payload(*spelled)) is not None
    async with Ledger.open(url, run="r") as ledger:
        await _session(ledger, "a-0", 0, spelled)
        await _session(ledger, "b-0", 0)
        await _session(ledger, "a-1", 1, spelled)
        await ledger.project()
        checked = await audit(ledger.engine)
        assert checked.ok, checked.divergences[:3]
        report = await prune(ledger, run="r", before_step=1)
        assert report.pruned_steps == [0] and report.events == 2
        checked = await audit(ledger.engine)
        assert checked.ok, checked.divergences[:3]
        assert set((await _marked(ledger)).values()) == set(report.prune_ids)
        # The unpruned step's spelling is the trajectory it was, and builds a batch.
        assert await _payload_at(ledger, "a-1") == _payload(*spelled)
        batch = await ledger.batch("train", 1, run="r", timeout=5)
        assert batch["prompts"][0][-len(spelled[0]) :].tolist() == spelled[0]
        again = await prune(ledger, run="r", keep_last=0)
        assert again.pruned_steps == [1]
        checked = await audit(ledger.engine)
        assert checked.ok, checked.divergences[:3]


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spelled=ids_spelling_a_tombstone())
def test_token_ids_that_spell_a_tombstone_are_a_trajectory(
    module_db_url: str, spelled: tuple[list[int], list[int], list[int]]
) -> None:
    asyncio.run(wipe(module_db_url))
    asyncio.run(_spelled(module_db_url, spelled))


async def _downgrade(url: str, target: str) -> None:
    from alembic import command

    def go(conn: Any) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, target)

    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(go)
    finally:
        await engine.dispose()


#: A prune id whose bytes fit token ids (each int32's high byte below 0x80), so a trajectory
#: can spell a tombstone of exactly this prune.
SPELLABLE_ID = uuid.UUID("0a0b0c0d-0e0f-4011-8213-141516171819")


async def _migrated(url: str) -> None:
    async with Ledger.open(url, run="r") as ledger:
        await _session(ledger, "a-0", 0)
        await _session(ledger, "b-0", 0)
        await ledger.project()
        first = await prune(ledger, run="r", before_step=1)
        assert first.prune_ids == [str(SPELLABLE_ID)]
        # After the prune, a trajectory of an unpruned step spells a tombstone of that very prune.
        forged = bytearray(retention.make_tombstone(str(SPELLABLE_ID), b"anything"))
        forged[60:] = bytes([1, 1, 0, 1])
        for high in range(3, 60, 4):
            forged[high] &= 0x7F
        ids = list(struct.unpack("<15i", bytes(forged[:60])))
        spelled = (ids[:11], ids[11:], [1, 1, 0, 1])
        stone = retention.read_tombstone(_payload(*spelled))
        assert stone is not None and stone.prune_id == str(SPELLABLE_ID)
        await _session(ledger, "a-1", 1, spelled)
        await ledger.project()
        marked = await _marked(ledger)
        assert len(marked) == 2
    # Back to the old form: the column and the record's step are gone, the bytes stay.
    await _downgrade(url, "0007")
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            columns = (await conn.execute(text("SELECT * FROM events LIMIT 1"))).keys()
            assert "pruned_by" not in columns
        await upgrade(engine)
    finally:
        await engine.dispose()
    async with Ledger.open(url, run="r") as ledger:
        assert await _marked(ledger) == marked  # the prune's own, not the spelling of step 1
        assert (await audit(ledger.engine)).ok
        with pytest.raises(StepPrunedError):  # the migrated record closes its step
            await _session(ledger, "late-0", 0)
        report = await prune(ledger, run="r", keep_last=0)
        assert report.pruned_steps == [1]
        checked = await audit(ledger.engine)
        assert checked.ok, checked.divergences[:3]


def test_migration_0008_converts_only_what_a_recorded_prune_wrote(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = iter([SPELLABLE_ID])  # the first prune's id; every later prune gets a fresh one
    monkeypatch.setattr(
        pruning, "uuid", SimpleNamespace(uuid4=lambda: next(first, None) or uuid.uuid4())
    )
    asyncio.run(_migrated(db_url))


# The mark is the claim a payload was pruned: moving it is caught as tampering with the bytes is.
TAMPERING = {
    "a tombstone unmarked": "UPDATE events SET pruned_by = NULL WHERE position = "
    "(SELECT min(position) FROM events WHERE pruned_by IS NOT NULL)",
    "a kept payload marked": "UPDATE events SET pruned_by = (SELECT max(pruned_by) FROM events) "
    "WHERE position = (SELECT min(position) FROM events WHERE global_step = 1 "
    "AND payload IS NOT NULL)",
    "a mark naming another prune": "UPDATE events SET pruned_by = "
    "'00000000-0000-4000-8000-000000000000' WHERE position = "
    "(SELECT min(position) FROM events WHERE pruned_by IS NOT NULL)",
}


async def _tampered(url: str, statement: str) -> None:
    async with Ledger.open(url, run="r") as ledger:
        await _session(ledger, "a-0", 0)
        await _session(ledger, "a-1", 1)
        await ledger.project()
        await prune(ledger, run="r", before_step=1)
        await _clean(ledger)
        async with ledger.engine.begin() as conn:
            assert (await conn.execute(text(statement))).rowcount == 1
        checked = await audit(ledger.engine)
        assert not checked.ok


async def _clean(ledger: Ledger) -> None:
    checked = await audit(ledger.engine)
    assert checked.ok, checked.divergences[:3]


@pytest.mark.parametrize("tampering", sorted(TAMPERING))
def test_a_moved_mark_fails_the_audit(db_url: str, tampering: str) -> None:
    asyncio.run(_tampered(db_url, TAMPERING[tampering]))
