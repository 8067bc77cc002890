"""The prune: replace the token payloads of a run's settled, consumed steps by tombstones
(`sessions.runs.retention`), record each step's `PayloadsPruned`, drop its queue rows, and give
the space back.

Per step, a fresh prune id: the step's payloads are read and their tombstones built, then the
record is appended under the append lock only if the step is still what was read — every
session created in it terminal, no payload added, every event projected, no other prune of it
(`store.retention.record_prune`); from that commit on the step is closed (the append refuses a
session created in it). Then the payloads are replaced and marked `pruned_by` the prune, and the
step's queue rows and claims dropped, in one transaction. A prune cut between the two is named by
`audit` and finished by the next prune, which rewrites only the payloads recorded before the
record, under the record's own id, and only if they still give the recorded count and digest.
It takes the ledger's parts (`sessions.runs.parts.LedgerParts`), never the `Ledger` that builds
on this room.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessions import events as ev
from sessions import storable
from sessions.errors import DamagedData, InvalidArgument, InvalidArgumentType
from sessions.runs.fingerprint import run_stream
from sessions.runs.parts import LedgerParts
from sessions.runs.retention import (
    PruneRecord,
    RetentionPolicy,
    make_tombstone,
    prune_records,
    recorded_policy,
)
from sessions.vocabulary import PARTITIONS, check_run
from store import AsyncEngine
from store import retention as sql

__all__ = ["PAGE", "PruneReport", "between_record_and_rewrite", "prune"]

#: Payloads read (and tombstones built) per page of a step.
PAGE = 2000
#: Tries per step when the step changed (or was not yet projected) between the prune's read and
#: its record; then the step is left for the next prune (`PruneReport.skipped_busy`).
_TRIES = 3

#: A seam for tests: awaited with each prune's id after its record committed and before its
#: rewrite, so a test can stop a prune in exactly that window (a kill, an exception).
between_record_and_rewrite: Callable[[str], Awaitable[None]] | None = None


@dataclass
class PruneReport:
    run: str
    partition: str
    pruned_steps: list[int] = field(default_factory=list)
    #: settled steps the bound covers that were kept: a consumer holds an unacked claim.
    skipped_claimed: list[int] = field(default_factory=list)
    #: steps the bound covers with a session not terminal when the prune came to record them.
    skipped_open: list[int] = field(default_factory=list)
    #: steps another prune recorded first (it prunes them; this one wrote nothing for them).
    skipped_pruned: list[int] = field(default_factory=list)
    #: steps that kept changing (new payloads, not yet projected) while this prune read them.
    skipped_busy: list[int] = field(default_factory=list)
    #: earlier prunes, cut between their record and their rewrite, this prune finished.
    finished_prune_ids: list[str] = field(default_factory=list)
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
    payloads; with `policy=True` the run's recorded `RetentionPolicy`). First, any earlier prune
    of the run cut between its record and its rewrite is finished (`finished_prune_ids`). A step
    with a claimed, unacked queue row is kept (`skipped_claimed`), and so is one that had a session
    not ended when the prune came to record it (`skipped_open`), that another prune recorded first
    (`skipped_pruned`) or that kept changing while read (`skipped_busy`). Then, on SQLite, the
    freed pages go back to the OS in small incremental-vacuum slices (`vacuum`)."""
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
    if not dry_run:
        report.finished_prune_ids = await _finish_all(ledger, run, records)
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
        outcome = await _prune_step(ledger, run, partition, step, bounds)
        if isinstance(outcome, _Skipped):
            getattr(report, outcome.kind).append(step)
            continue
        events, size, rows, prune_id = outcome
        report.pruned_steps.append(step)
        report.events += events
        report.payload_bytes += size
        report.queue_rows += rows
        report.prune_ids.append(prune_id)
    if vacuum and not dry_run:
        report.pages_freed = await sql.incremental_vacuum(engine)
    report.bytes_after = await sql.database_bytes(engine)
    return report


@dataclass(frozen=True)
class _Skipped:
    kind: str  # the PruneReport list the step goes to


@dataclass
class _Stones:
    """A step's tombstones for one prune id, built from the payloads it read."""

    pairs: list[tuple[int, bytes]]  # (position, tombstone)
    size: int  # bytes of the payloads they replace
    digest: str  # SHA-256 over the tombstones in position order
    read: sql.StepPayloads


async def _tombstones(
    engine: AsyncEngine,
    run: str,
    partition: str,
    step: int,
    prune_id: str,
    before: int | None = None,
) -> _Stones:
    """Tombstones of the step's payloads no prune replaced (recorded before `before`)."""
    out: list[tuple[int, bytes]] = []
    size, after, chain = 0, 0, hashlib.sha256()
    while True:
        async with engine.connect() as conn:
            page = await sql.payload_page(
                conn, run, partition, [step], after=after, limit=PAGE, before=before
            )
        if not page:
            break
        for position, payload in page:
            stone = make_tombstone(prune_id, payload)
            size += len(payload)
            chain.update(stone)
            out.append((position, stone))
        after = page[-1][0]
    return _Stones(out, size, chain.hexdigest(), sql.StepPayloads(len(out), after))


async def _prune_step(
    ledger: LedgerParts, run: str, partition: str, step: int, bounds: dict[str, Any]
) -> tuple[int, int, int, str] | _Skipped:
    """Record and rewrite one step's prune, under a fresh id each try; or why it was skipped."""
    for _try in range(_TRIES):
        prune_id = str(uuid.uuid4())
        stones = await _tombstones(ledger.engine, run, partition, step, prune_id)
        event = storable.clean_event(
            run_stream(run),
            ev.PayloadsPruned(
                prune_id=prune_id,
                partition=partition,
                steps=[step],
                events=len(stones.pairs),
                bytes=stones.size,
                digest=stones.digest,
                bound={k: v for k, v in bounds.items() if v is not None},
            ),
        )
        # The record carries its step's partition and step, so the append can find it.
        record = ev.envelope(
            event,
            session_id=run_stream(run),
            version=0,  # set under the append lock
            run=run,
            uid="",
            partition=partition,
            global_step=step,
        )
        status, _detail = await sql.record_prune(
            ledger.engine,
            record,
            step=step,
            read=stones.read,
            terminal_types=sorted(ev.TERMINAL_EVENTS),
        )
        if status == sql.ALREADY_PRUNED:
            return _Skipped("skipped_pruned")
        if status == sql.OPEN_SESSIONS:
            return _Skipped("skipped_open")
        if status == sql.NOT_PROJECTED:
            await ledger.project()
        if status != "recorded":
            continue
        if between_record_and_rewrite is not None:
            await between_record_and_rewrite(prune_id)
        rows = await sql.apply_prune(ledger.engine, run, partition, [step], prune_id, stones.pairs)
        return len(stones.pairs), stones.size, rows, prune_id
    return _Skipped("skipped_busy")


async def _finish_all(ledger: LedgerParts, run: str, records: Sequence[PruneRecord]) -> list[str]:
    """Finish every recorded prune of the run whose rewrite did not happen (cut between its
    record and its rewrite); returns their ids."""
    by_partition: dict[str, list[PruneRecord]] = {}
    for record in records:
        by_partition.setdefault(record.partition, []).append(record)
    finished: list[str] = []
    for partition, recorded in by_partition.items():
        steps = sorted({s for r in recorded for s in r.steps})
        async with ledger.engine.connect() as conn:
            leftover = await sql.leftover_steps(conn, run, partition, steps)
        for record in recorded:
            if leftover & set(record.steps):
                await _finish(ledger, run, record)
                finished.append(record.prune_id)
    return finished


async def _finish(ledger: LedgerParts, run: str, record: PruneRecord) -> None:
    """Apply a recorded prune whose payloads are not all replaced: the payloads of its steps
    recorded before its record, under its own id, if they give the count and digest it recorded."""
    for step in record.steps:
        stones = await _tombstones(
            ledger.engine, run, record.partition, step, record.prune_id, before=record.position
        )
        whole = len(record.steps) == 1
        if (
            whole
            and stones.pairs
            and (len(stones.pairs), stones.digest) != (record.events, record.digest)
        ):
            async with ledger.engine.connect() as conn:
                rewritten = await sql.rewritten_by(
                    conn, run, record.partition, step, record.prune_id
                )
            if rewritten:  # another process finished it while this one read: nothing to do
                continue
            raise DamagedData(
                f"prune {record.prune_id} (run {run!r} {record.partition} step {step}, log position "
                f"{record.position}) cannot be finished: the step's payloads give "
                f"{len(stones.pairs)} tombstones with digest {stones.digest[:12]}…, it recorded "
                f"{record.events} with {record.digest[:12]}…; nothing was rewritten — run "
                "`rollout-ledger audit` to see what changed"
            )
        await sql.apply_prune(
            ledger.engine, run, record.partition, [step], record.prune_id, stones.pairs
        )
