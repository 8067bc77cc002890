"""The prune: replace the token payloads of a run's settled, consumed steps by tombstones
(`sessions.runs.retention`), record each step's `PayloadsPruned`, drop its queue rows, and give
the space back.

The event is appended first and the payloads replaced after, in one transaction with the queue
rows' deletion: a prune interrupted between the two is finished by the next prune of the run.
The steps' queue rows (and their claims) are dropped; a replay drops them too, and a batch of a
pruned step raises `BatchPruned` naming the prune. It takes the ledger's parts
(`sessions.runs.parts.LedgerParts`), never the `Ledger` that builds on this room.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sessions import events as ev
from sessions import storable
from sessions.errors import InvalidArgument, InvalidArgumentType, UsageError
from sessions.runs.fingerprint import run_envelope, run_stream
from sessions.runs.parts import LedgerParts
from sessions.runs.retention import (
    TOMBSTONE_SIZE,
    PruneRecord,
    RetentionPolicy,
    make_tombstone,
    prune_records,
    read_tombstone,
    recorded_policy,
)
from sessions.vocabulary import PARTITIONS, check_run
from store import AsyncEngine
from store import read_models as rm
from store import retention as sql

__all__ = ["PAGE", "PruneReport", "prune"]

#: Payloads read (and tombstones built) per page of a step.
PAGE = 2000


@dataclass
class PruneReport:
    run: str
    partition: str
    pruned_steps: list[int] = field(default_factory=list)
    #: settled steps the bound covers that were kept: a consumer holds an unacked claim.
    skipped_claimed: list[int] = field(default_factory=list)
    events: int = 0
    payload_bytes: int = 0
    queue_rows: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    pages_freed: int = 0
    prune_ids: list[str] = field(default_factory=list)


def _selected(
    steps: Sequence[tuple[int, int, int]],
    keep_last: int | None,
    before_step: int | None,
    max_payload_bytes: int | None,
) -> set[int]:
    """The steps a bound covers, from (step, open sessions, payload bytes) of every step."""
    ordered = sorted(s for s, _o, _b in steps)
    chosen: set[int] = set()
    if keep_last is not None:
        chosen |= set(ordered[: max(0, len(ordered) - keep_last)])
    if before_step is not None:
        chosen |= {s for s in ordered if s < before_step}
    if max_payload_bytes is not None:
        total = 0
        for step, _open, size in sorted(steps, reverse=True):
            total += size
            if total > max_payload_bytes:
                chosen.add(step)
    return chosen


async def prune(
    ledger: LedgerParts,
    *,
    run: str | None = None,
    partition: str = "train",
    keep_last: int | None = None,
    before_step: int | None = None,
    max_payload_bytes: int | None = None,
    policy: bool = False,
    vacuum: bool = True,
    dry_run: bool = False,
) -> PruneReport:
    """Prune the payloads of the run's settled steps the bound covers (keep the last
    `keep_last` steps, prune steps before `before_step`, keep at most `max_payload_bytes` of
    payloads; with `policy=True` the run's recorded `RetentionPolicy`). A step with a claimed,
    unacked queue row is kept (`skipped_claimed`). Then, on SQLite, the freed pages go back to the
    OS in small incremental-vacuum slices (`vacuum`)."""
    if not isinstance(ledger, LedgerParts):
        raise InvalidArgumentType(
            f"prune: the first argument is a Ledger, got {type(ledger).__name__}",
            argument="ledger",
        )
    run = ledger.run if run is None else check_run(run)
    if not isinstance(partition, str) or partition not in PARTITIONS:
        raise InvalidArgument(f"partition must be one of {PARTITIONS}, got {partition!r}")
    for name, flag in (("policy", policy), ("vacuum", vacuum), ("dry_run", dry_run)):
        if not isinstance(flag, bool):
            raise InvalidArgumentType(f"prune: {name} must be a bool, got {flag!r:.40}")
    if policy:
        recorded = await recorded_policy(ledger.engine, run)
        keep_last = recorded.keep_last_steps if keep_last is None else keep_last
        before_step = recorded.keep_from_step if before_step is None else before_step
        if max_payload_bytes is None:
            max_payload_bytes = recorded.max_payload_bytes
    bounds = {
        "keep_last": keep_last,
        "before_step": before_step,
        "max_payload_bytes": max_payload_bytes,
    }
    RetentionPolicy(keep_last, before_step, max_payload_bytes)  # the same checks
    if all(v is None for v in bounds.values()):
        raise InvalidArgument(
            "prune needs a bound: keep_last, before_step or max_payload_bytes (or policy=True "
            "with a recorded retention policy)"
        )
    engine = ledger.engine
    await ledger.project()
    report = PruneReport(run, partition)
    report.bytes_before = await sql.database_bytes(engine)
    records = await prune_records(engine, run)
    if records:
        await _finish(ledger, run, records[-1])  # a prune interrupted after its event
    done = {s for r in records if r.partition == partition for s in r.steps}
    async with engine.connect() as conn:
        steps = await sql.step_sizes(conn, run, partition, with_bytes=max_payload_bytes is not None)
    chosen = _selected(steps, keep_last, before_step, max_payload_bytes)
    settled = {s for s, open_, _b in steps if open_ == 0}
    candidates = sorted((chosen & settled) - done)
    async with engine.connect() as conn:
        claimed = set(await sql.open_claims(conn, run, partition, candidates))
    report.skipped_claimed = sorted(claimed)
    for step in candidates:
        if step in claimed:
            continue
        if dry_run:
            report.pruned_steps.append(step)
            continue
        events, size, rows, prune_id = await _prune_step(ledger, run, partition, step, bounds)
        report.pruned_steps.append(step)
        report.events += events
        report.payload_bytes += size
        report.queue_rows += rows
        report.prune_ids.append(prune_id)
    if vacuum and not dry_run:
        report.pages_freed = await sql.incremental_vacuum(engine)
    report.bytes_after = await sql.database_bytes(engine)
    return report


async def _tombstones(
    engine: AsyncEngine, run: str, partition: str, step: int, prune_id: str
) -> tuple[list[tuple[int, bytes]], int, str]:
    """The step's (position, tombstone) pairs, the bytes they replace, their digest."""
    out: list[tuple[int, bytes]] = []
    size, after, chain = 0, 0, hashlib.sha256()
    while True:
        async with engine.connect() as conn:
            page = await sql.payload_page(conn, run, partition, [step], after=after, limit=PAGE)
        if not page:
            break
        for position, payload in page:
            existing = read_tombstone(payload)
            if existing is not None and existing.prune_id == prune_id:
                stone = payload  # already replaced (a prune being finished)
                size += existing.length
            elif existing is not None:
                raise UsageError(f"position {position}: pruned already by {existing.prune_id}")
            else:
                stone = make_tombstone(prune_id, payload)
                size += len(payload)
            chain.update(stone)
            out.append((position, stone))
        after = page[-1][0]
    return out, size, chain.hexdigest()


async def _prune_step(
    ledger: LedgerParts, run: str, partition: str, step: int, bounds: dict[str, Any]
) -> tuple[int, int, int, str]:
    prune_id = str(uuid.uuid4())
    stones, size, digest = await _tombstones(ledger.engine, run, partition, step, prune_id)
    stream = run_stream(run)
    stored = await ledger.store.read_stream(stream)
    event = storable.clean_event(
        stream,
        ev.PayloadsPruned(
            prune_id=prune_id,
            partition=partition,
            steps=[step],
            events=len(stones),
            bytes=size,
            digest=digest,
            bound={k: v for k, v in bounds.items() if v is not None},
        ),
    )
    envelope = run_envelope(event, run, version=len(stored) + 1)
    await ledger.store.submit(stream, len(stored), [envelope])
    rows = await sql.apply_prune(ledger.engine, run, partition, [step], stones)
    return len(stones), size, rows, prune_id


async def _finish(ledger: LedgerParts, run: str, record: PruneRecord) -> None:
    """Apply a recorded prune whose payloads are not all replaced yet (interrupted)."""
    async with ledger.engine.connect() as conn:
        pending = await sql.unpruned_count(
            conn, run, record.partition, record.steps, TOMBSTONE_SIZE
        )
        rows = await rm.queue_rows_for(conn, run, record.partition, record.steps[0])
    if not pending and not rows:
        return
    for step in record.steps:
        stones, _size, _digest = await _tombstones(
            ledger.engine, run, record.partition, step, record.prune_id
        )
        await sql.apply_prune(ledger.engine, run, record.partition, [step], stones)
