"""Durable queue consumers (docs/design.md §7): claim / ack / release on `queue_rows`, both backends.

What must hold: several consumers (tasks with their own connections, or OS processes) never get
the same row and together get every row once; unacked rows stay with their claimer for the
lease and come back after it; acked rows never come back; a consumer killed mid-claim loses
nothing; claimed rows build into a padded batch whose placeholders have an all-zero mask.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import and_, func, select

from sessions import Ledger
from sessions.errors import InvalidInput
from sessions.queues.consumer import QueueConsumer
from store import create_engine
from store import queue_claims as qc
from store.dialects import WRITE_LOCK
from store.schema.tables import queue_claims, queue_rows

RUN = "default"
PART = "train"


# ----------------------------------------------------------------------------- recording
async def _ok(handle: Any) -> None:
    await handle.record_trajectory(prompt_ids=[5, 6, 7], response_ids=[8, 9])
    await handle.post_reward(1.0)


async def _boom(handle: Any) -> None:
    raise RuntimeError("sandbox fell over")


async def record(
    ledger: Ledger,
    *,
    uids: int,
    group_size: int = 3,
    global_step: int | None = 0,
    prefix: str = "",
    fail_index: int = 1,
) -> None:
    """`uids` groups of `group_size` sessions; session `fail_index` of each fails (a placeholder row)."""
    await asyncio.gather(
        *(
            ledger.run_session(
                _boom if i == fail_index else _ok,
                f"{prefix}s{u}_{i}",
                uid=f"{prefix}u{u}",
                session_index=i,
                group_size=group_size,
                partition=PART,
                global_step=global_step,
            )
            for u in range(uids)
            for i in range(group_size)
        )
    )


async def row_ids(engine: Any, *, kind: str = "row") -> list[int]:
    async with engine.connect() as conn:
        result = await conn.execute(
            select(queue_rows.c.id).where(queue_rows.c.kind == kind).order_by(queue_rows.c.id)
        )
        return [int(i) for i in result.scalars()]


@dataclass
class Queue:
    url: str
    ledger: Ledger
    ids: list[int]


@pytest.fixture
async def queue(db_url: str) -> AsyncIterator[Queue]:
    """10 groups of 3 sessions at step 0, one failed session (placeholder row) per group."""
    async with Ledger.open(db_url) as ledger:
        await record(ledger, uids=10)
        await ledger.project()
        ids = await row_ids(ledger.engine)
        assert len(ids) == 30
        yield Queue(db_url, ledger, ids)


async def drain(consumer: QueueConsumer, limit: int) -> list[int]:
    """Claim until the queue is empty, acking each claim; the ids this consumer got, in order."""
    got: list[int] = []
    while True:
        rows = await consumer.claim_rows(limit)
        if not rows:
            return got
        ids = [r["id"] for r in rows]
        assert ids == sorted(ids)
        got.extend(ids)
        await asyncio.sleep(0)  # let the others interleave between claim and ack
        assert await consumer.ack(ids) == len(ids)


# ------------------------------------------------------------------- (a) concurrency
@pytest.mark.parametrize("consumers,limit", [(2, 3), (6, 1)])
async def test_concurrent_consumers_get_every_row_exactly_once(
    queue: Queue, consumers: int, limit: int
) -> None:
    engines = [create_engine(queue.url) for _ in range(consumers)]  # own pools: real concurrency
    try:
        workers = [
            QueueConsumer(engine, f"c{n}", run=RUN, partition=PART)
            for n, engine in enumerate(engines)
        ]
        results = await asyncio.wait_for(asyncio.gather(*(drain(w, limit) for w in workers)), 30)
    finally:
        for engine in engines:
            await engine.dispose()
    flat = [i for got in results for i in got]
    assert len(flat) == len(set(flat)), "a row was handed to two consumers"
    assert sorted(flat) == queue.ids
    async with queue.ledger.engine.connect() as conn:
        acked = (
            await conn.execute(select(func.count()).where(queue_claims.c.acked_at.is_not(None)))
        ).scalar_one()
    assert acked == len(queue.ids)


def _drain_process(url: str, name: str, start: Any, out: Any) -> None:
    """Child process: wait for the start signal, drain the queue, report the ids it got."""

    async def main() -> list[int]:
        engine = create_engine(url)
        try:
            async with engine.connect():
                pass  # connect before the start signal, so both children race on claims only
            start.wait(30)
            return await drain(QueueConsumer(engine, name, run=RUN, partition=PART), 2)
        finally:
            await engine.dispose()

    out.put((name, asyncio.run(main())))


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_two_processes_get_every_row_exactly_once(queue: Queue) -> None:
    """PostgreSQL only: SQLite's cross-process exclusion (BEGIN IMMEDIATE) is exercised by the kill test."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_drain_process, args=(queue.url, f"p{n}", start, out)) for n in range(2)
    ]
    for p in procs:
        p.start()
    try:
        start.set()
        results = dict(await asyncio.to_thread(lambda: [out.get(timeout=30) for _ in procs]))
        for p in procs:
            await asyncio.to_thread(p.join, 10)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    flat = results["p0"] + results["p1"]
    assert len(flat) == len(set(flat)), "a row was handed to both processes"
    assert sorted(flat) == queue.ids


# ---------------------------------------------------------- (b) lease, (c) ack, release
async def test_unacked_rows_stay_with_their_claimer_for_the_lease_then_come_back(
    queue: Queue,
) -> None:
    lease = 1.0
    a = QueueConsumer(queue.ledger, "a", run=RUN, partition=PART, lease_seconds=lease)
    b = QueueConsumer(queue.ledger, "b", run=RUN, partition=PART, lease_seconds=lease)
    claimed_at = time.monotonic()
    held = [r["id"] for r in await a.claim_rows(4)]  # a "dies": never acks
    assert held == queue.ids[:4]
    rest = [r["id"] for r in await b.claim_rows(100)]
    assert rest == queue.ids[4:]
    assert await b.ack(rest) == len(rest)
    assert await b.claim_rows(100) == []  # within a's lease: nothing to hand out
    await asyncio.sleep(max(0.0, lease + 0.2 - (time.monotonic() - claimed_at)))
    again = [r["id"] for r in await b.claim_rows(100)]
    assert again == held  # the dead consumer's rows come back
    assert await a.ack(held) == 0  # a lost them: its late ack does not count
    assert await b.ack(again) == len(held)
    assert await b.claim_rows(100) == []


async def test_acked_rows_are_never_handed_out_again(queue: Queue) -> None:
    a = QueueConsumer(queue.ledger, "a", run=RUN, partition=PART, lease_seconds=0.2)
    rows = await a.claim_rows(10)
    ids = [r["id"] for r in rows]
    assert await a.ack(ids[:6]) == 6
    assert await a.ack(ids[:6]) == 0  # already acked: idempotent, counts nothing
    await asyncio.sleep(0.3)  # every lease has expired: only the unacked rows may come back
    b = QueueConsumer(queue.ledger, "b", run=RUN, partition=PART, lease_seconds=0.2)
    seen = [r["id"] for r in await b.claim_rows(100)]
    assert set(seen).isdisjoint(ids[:6])
    assert sorted(seen) == sorted(set(queue.ids) - set(ids[:6]))
    assert await b.ack(seen) == len(seen)
    await asyncio.sleep(0.3)
    assert await b.claim_rows(100) == []
    assert await a.release(ids) == 0  # release cannot undo an ack


async def test_release_hands_rows_back_at_once_and_only_the_holder_may(queue: Queue) -> None:
    a = QueueConsumer(queue.ledger, "a", run=RUN, partition=PART)
    b = QueueConsumer(queue.ledger, "b", run=RUN, partition=PART)
    ids = [r["id"] for r in await a.claim_rows(5)]
    assert await b.release(ids) == 0 and await b.ack(ids) == 0  # not b's to release or ack
    assert [r["id"] for r in await b.claim_rows(3)] == queue.ids[5:8]
    assert await a.release(ids[:2]) == 2
    assert [r["id"] for r in await b.claim_rows(3)] == [*ids[:2], queue.ids[8]]  # id order again
    assert await a.ack(ids) == 3  # the two released rows are no longer a's
    assert await a.release([]) == 0 and await a.ack([]) == 0


async def test_the_claim_write_refuses_a_live_claim_even_if_the_select_missed_it(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PostgreSQL race (snapshot older than a rival's commit) made deterministic: with the
    candidate filter blinded, every claimed row looks available, and the upsert must refuse it."""
    a = QueueConsumer(queue.ledger, "a", run=RUN, partition=PART)
    b = QueueConsumer(queue.ledger, "b", run=RUN, partition=PART)
    held = [r["id"] for r in await a.claim_rows(30)]
    assert await a.ack(held[:10]) == 10

    def blind(cutoff: object) -> object:
        return and_(queue_claims.c.queue_row_id == queue_rows.c.id, queue_claims.c.queue_row_id < 0)

    monkeypatch.setattr(qc, "_live_claim", blind)
    assert await b.claim_rows(5) == []
    async with queue.ledger.engine.connect() as conn:
        owners = dict(
            (await conn.execute(select(queue_claims.c.queue_row_id, queue_claims.c.consumer))).all()
        )
    assert owners == {i: "a" for i in held}


def _hold_process(url: str, lease: float, out: Any) -> None:
    """Child process: claim 3 rows and commit, claim 3 more and stop mid-transaction, wait to be killed."""

    async def main() -> None:
        engine = create_engine(url)
        committed = await qc.claim(
            engine, "doomed", run=RUN, partition=PART, limit=3, lease_seconds=lease
        )
        conn = await (await engine.connect()).execution_options(**{WRITE_LOCK: True})
        await conn.begin()
        pending = await qc.claim_in(
            conn, "doomed", run=RUN, partition=PART, limit=3, lease_seconds=lease
        )
        out.put(([r["id"] for r in committed], [r["id"] for r in pending], time.time()))
        await asyncio.sleep(120)

    asyncio.run(main())


async def test_a_consumer_killed_mid_claim_loses_no_rows(queue: Queue) -> None:
    lease = 0.5
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_hold_process, args=(queue.url, lease, out))
    child.start()
    try:
        committed, pending, claimed_at = await asyncio.to_thread(out.get, True, 30)
        assert committed == queue.ids[:3] and pending == queue.ids[3:6]
        # A long lease while the child lives, so a slow machine cannot make its claim look stale.
        other = QueueConsumer(queue.ledger, "other", run=RUN, partition=PART, lease_seconds=300)
        first = asyncio.ensure_future(other.claim_rows(100))
        if queue.ledger.engine.dialect.name == "postgresql":
            # SKIP LOCKED: the dying consumer's in-flight rows are skipped, not waited for.
            got = [r["id"] for r in await asyncio.wait_for(first, 10)]
            assert got == queue.ids[6:]
        else:
            # SQLite: its open transaction holds the write lock, so claimers queue behind it.
            await asyncio.sleep(0.3)
            assert not first.done()
        child.kill()
        await asyncio.to_thread(child.join, 10)
        if queue.ledger.engine.dialect.name == "postgresql":
            # The killed transaction rolled back: its rows are free at once, no lease to wait out.
            got += [r["id"] for r in await other.claim_rows(100)]
            assert got == queue.ids[6:] + pending
        else:
            got = [r["id"] for r in await asyncio.wait_for(first, 30)]
            assert got == queue.ids[3:]
        assert await other.ack(got) == len(got)
        assert await other.claim_rows(100) == []  # the committed claim is still within its lease
        # Its committed claim comes back once the (child's) lease has run out.
        await asyncio.sleep(max(0.0, claimed_at + lease + 0.1 - time.time()))
        reaper = QueueConsumer(queue.ledger, "other", run=RUN, partition=PART, lease_seconds=lease)
        assert [r["id"] for r in await reaper.claim_rows(100)] == committed
    finally:
        if child.is_alive():
            child.kill()
            child.join()


# ------------------------------------------------------------------ (d) claim_batch
async def test_claim_batch_builds_padded_rows_with_zero_mask_placeholders(queue: Queue) -> None:
    consumer = QueueConsumer(queue.ledger, "trainer", run=RUN, partition=PART)
    batch, ids = await consumer.claim_batch(25, global_step=0, pad_token_id=0)
    assert ids == queue.ids[:25]
    assert batch is not None and batch.batch_size[0] == 25
    placeholder = batch["is_placeholder"]
    async with queue.ledger.engine.connect() as conn:  # the claimed rows' own placeholder flags
        flags = dict(
            (
                await conn.execute(
                    select(queue_rows.c.id, queue_rows.c.is_placeholder).where(
                        queue_rows.c.id.in_(ids)
                    )
                )
            ).all()
        )
    assert placeholder.tolist() == [flags[i] for i in ids]
    assert placeholder.sum() >= 5  # one failed session per group: 5-10 of any 25 of the 30 rows
    mask = batch["response_mask"]
    assert mask[placeholder].sum() == 0  # placeholders contribute no gradient
    assert (mask[~placeholder].sum(dim=1) == 2).all()
    assert batch["rm_scores"][placeholder].sum() == 0
    assert batch["rm_scores"][~placeholder].sum() == (~placeholder).sum()
    assert batch["responses"].shape == (25, 2) and batch["prompts"].shape == (25, 3)
    assert await consumer.ack(ids) == 25
    rest, rest_ids = await consumer.claim_batch(100)
    assert rest_ids == queue.ids[25:] and rest is not None
    assert int(rest["is_placeholder"].sum()) == 10 - int(placeholder.sum())  # the remaining ones
    assert await consumer.release(rest_ids) == len(rest_ids)
    assert await consumer.claim_batch(5, global_step=1) == (None, [])


async def test_claim_batch_releases_its_rows_when_the_batch_cannot_be_built(queue: Queue) -> None:
    from sessions.batches import BatchTooLongError

    consumer = QueueConsumer(queue.ledger, "trainer", run=RUN, partition=PART)
    with pytest.raises(BatchTooLongError):
        await consumer.claim_batch(30, max_response_length=1)  # responses have 2 tokens
    other = QueueConsumer(queue.ledger, "other", run=RUN, partition=PART)
    assert [r["id"] for r in await other.claim_rows(30)] == queue.ids


async def test_claims_select_by_step_and_skip_group_tags(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        await record(ledger, uids=2, group_size=2, global_step=0, prefix="a")
        await record(ledger, uids=2, group_size=2, global_step=1, prefix="b")
        await record(ledger, uids=1, group_size=2, global_step=None, prefix="c")
        await ledger.project()
        consumer = QueueConsumer(ledger, "c", run=RUN, partition=PART)
        step1 = await consumer.claim_rows(100, global_step=1)
        assert len(step1) == 4 and {r["global_step"] for r in step1} == {1}
        no_step = await consumer.claim_rows(100, global_step=None)
        assert len(no_step) == 2 and {r["global_step"] for r in no_step} == {None}
        rest = await consumer.claim_rows(100)
        assert len(rest) == 4 and {r["global_step"] for r in rest} == {0}
        claimed = step1 + no_step + rest
        assert {r["kind"] for r in claimed} == {"row"}
        assert (
            len(await row_ids(ledger.engine, kind="tag")) == 5
        )  # tags exist but are never claimed
        assert await QueueConsumer(ledger, "v", run=RUN, partition="val").claim_rows(100) == []
        assert (
            await QueueConsumer(ledger, "o", run="other-run", partition=PART).claim_rows(100) == []
        )


# ------------------------------------------------------------------- (e) bad input
async def test_bad_input_is_a_clear_value_error(queue: Queue) -> None:
    engine = queue.ledger.engine
    consumer = QueueConsumer(queue.ledger, "c", run=RUN, partition=PART)
    for limit in (0, -1, True, 1.5, None):
        with pytest.raises(ValueError, match="limit must be a positive integer"):
            await consumer.claim_rows(limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        await consumer.claim_batch(0)
    with pytest.raises(InvalidInput, match="'test' is not a partition; use 'train' or 'val'"):
        QueueConsumer(queue.ledger, "c", run=RUN, partition="test")
    # The store takes a partition as a value to filter by; the vocabulary is the consumer's.
    assert await qc.claim(engine, "c", run=RUN, partition="TRAIN", limit=1) == []
    with pytest.raises(ValueError, match="consumer name"):
        QueueConsumer(queue.ledger, "", run=RUN, partition=PART)
    with pytest.raises(ValueError, match="at most 128"):
        await qc.claim(engine, "x" * 129, run=RUN, partition=PART, limit=1)
    with pytest.raises(ValueError, match="lease_seconds"):
        QueueConsumer(queue.ledger, "c", run=RUN, partition=PART, lease_seconds=0)
    with pytest.raises(ValueError, match="global_step must be"):
        await consumer.claim_rows(1, global_step="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="run must be"):
        await qc.claim(engine, "c", run="", partition=PART, limit=1)
    with pytest.raises(ValueError, match="queue row ids are integers"):
        await consumer.ack(["1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="Ledger or an AsyncEngine"):
        QueueConsumer(queue.url, "c", run=RUN, partition=PART)  # type: ignore[arg-type]
    assert await consumer.claim_rows(1) != []  # nothing above claimed anything
