"""Retention: prune the token payloads of settled, consumed steps and keep the audit.

Each pruned event's payload is replaced by a 64-byte tombstone holding the original payload's
length and SHA-256 and the prune's id (docs/decisions.md, "Retention"); the event's JSON `data`
is never rewritten. Each pruned step gets a `PayloadsPruned` event in the run's own stream
(`@run:<run>`) naming the steps, when, how many events and bytes, and the SHA-256 over its
tombstones in position order, so `audit` can prove every tombstone is one a recorded prune wrote.
The steps' queue rows (and their claims) are dropped; a replay drops them too, and a batch of a
pruned step raises `BatchPruned` naming the prune.

The event is appended first and the payloads replaced after, in one transaction with the queue
rows' deletion: a prune interrupted between the two is finished by the next prune of the run.

A run's retention policy (`RetentionPolicy`, `LedgerConfig.retention`) is part of its recorded
configuration, so `prune(policy=True)` and a replay read it from the log.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sessions import events as ev
from sessions import storable
from sessions.errors import (
    BatchPruned,
    ConfigError,
    InvalidArgument,
    InvalidArgumentType,
    UsageError,
)
from sessions.runs.fingerprint import run_envelope, run_stream
from store import AsyncEngine, load_json
from store import read_models as rm
from store import retention as sql

if TYPE_CHECKING:
    from sessions.ledger import Ledger

__all__ = [
    "PruneRecord",
    "PruneReport",
    "RetentionPolicy",
    "TOMBSTONE_SIZE",
    "Tombstone",
    "check_pruned",
    "make_tombstone",
    "prune",
    "prune_records",
    "read_tombstone",
    "recorded_policy",
]

_MAGIC = b"\x00RLPRUN\x01"
_LAYOUT = struct.Struct("<8s16sQ32s")  # magic, prune id, original length, SHA-256
TOMBSTONE_SIZE = _LAYOUT.size  # 64
#: Payloads read (and tombstones built) per page of a step.
PAGE = 2000


# ------------------------------------------------------------------------------- tombstones
@dataclass(frozen=True, slots=True)
class Tombstone:
    prune_id: str
    length: int
    sha256: str


def make_tombstone(prune_id: str, payload: bytes) -> bytes:
    return _LAYOUT.pack(
        _MAGIC, uuid.UUID(prune_id).bytes, len(payload), hashlib.sha256(payload).digest()
    )


def read_tombstone(payload: bytes | None) -> Tombstone | None:
    """The tombstone a prune left in place of a payload, or None for a payload that is not one."""
    if payload is None or len(payload) != TOMBSTONE_SIZE or not payload.startswith(_MAGIC):
        return None
    _magic, pid, length, digest = _LAYOUT.unpack(bytes(payload))
    return Tombstone(str(uuid.UUID(bytes=pid)), int(length), digest.hex())


# ----------------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class RetentionPolicy:
    """What a run keeps: the payloads of its last `keep_last_steps` steps (None: all), of steps
    from `keep_from_step` on, and at most `max_payload_bytes` of payloads (the newest steps that
    fit). Recorded in the run's configuration (`LedgerConfig.retention`)."""

    keep_last_steps: int | None = None
    keep_from_step: int | None = None
    max_payload_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last_steps", "keep_from_step", "max_payload_bytes"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ConfigError(
                    f"retention {name}: must be an integer >= 0 or None, got {value!r}",
                    argument=name,
                )

    def as_config(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> RetentionPolicy:
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            raise ConfigError(f"retention: a mapping or RetentionPolicy, got {config!r:.80}")
        unknown = set(config) - {"keep_last_steps", "keep_from_step", "max_payload_bytes"}
        if unknown:
            raise ConfigError(f"retention: unknown keys {sorted(unknown)}", argument="retention")
        return cls(**dict(config))

    @property
    def empty(self) -> bool:
        return not self.as_config()


async def recorded_policy(engine: AsyncEngine, run: str) -> RetentionPolicy:
    """The retention policy in the run's last recorded configuration (empty if none)."""
    async with engine.connect() as conn:
        rows = await sql.run_stream_events(conn, run_stream(run), "RunConfigured")
    if not rows:
        return RetentionPolicy()
    data = _json(rows[-1][2])
    return RetentionPolicy.from_config((data.get("config") or {}).get("retention"))


# ---------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class PruneRecord:
    """One `PayloadsPruned` event as read back."""

    prune_id: str
    partition: str
    steps: tuple[int, ...]
    events: int
    bytes: int
    digest: str
    position: int
    recorded_at: str


def _json(raw: Any) -> dict[str, Any]:
    return raw if isinstance(raw, dict) else load_json(raw)


async def prune_records(engine: AsyncEngine, run: str) -> list[PruneRecord]:
    async with engine.connect() as conn:
        rows = await sql.run_stream_events(conn, run_stream(run), "PayloadsPruned")
    out = []
    for position, recorded_at, raw in rows:
        data = _json(raw)
        out.append(
            PruneRecord(
                data["prune_id"],
                data["partition"],
                tuple(int(s) for s in data["steps"]),
                int(data["events"]),
                int(data["bytes"]),
                data["digest"],
                int(position),
                str(recorded_at),
            )
        )
    return out


async def check_pruned(
    engine: AsyncEngine, run: str, partition: str, global_step: int | None
) -> None:
    """Raise `BatchPruned` if a prune dropped this step's payloads."""
    if global_step is None:
        return
    for record in await prune_records(engine, run):
        if record.partition == partition and global_step in record.steps:
            raise BatchPruned(
                f"run {run!r} {partition} step {global_step}: its token payloads were pruned at "
                f"{record.recorded_at} (prune {record.prune_id}, log position {record.position}, "
                f"steps {_span(record.steps)}); its batch cannot be built from this database — "
                "metrics and the audit still cover it",
                run=run,
                partition=partition,
                global_step=global_step,
                prune_id=record.prune_id,
                pruned_at=record.recorded_at,
                steps=record.steps,
            )


def _span(steps: Sequence[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{min(steps)}..{max(steps)} ({len(steps)})"


# ------------------------------------------------------------------------------------ prune
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
    ledger: Ledger,
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
    from sessions.ledger import Ledger
    from sessions.vocabulary import PARTITIONS, check_run

    if not isinstance(ledger, Ledger):
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
    ledger: Ledger, run: str, partition: str, step: int, bounds: dict[str, Any]
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


async def _finish(ledger: Ledger, run: str, record: PruneRecord) -> None:
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
