"""Audit: check the log itself, replay it in isolation, and compare with what is stored.

The report names the first divergence precisely — table, session, event position, field,
expected (from replay) and found (stored) — so an auditor can go straight to it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from sessions import events as ev
from sessions import tokens
from sessions.errors import UnknownEventError
from sessions.projector import ProjectionError
from sessions.replay import replay
from store import read_models as rm
from store.engine import create_engine
from store.migrate import upgrade
from store.tables import events as events_table
from store.tables import groups, metric_counts, queue_rows, sessions

TERMINAL = {"SessionSucceeded", "SessionFailed", "SessionCancelled"}


@dataclass(frozen=True)
class Divergence:
    table: str
    key: str
    field: str
    expected: Any
    found: Any
    session_id: str | None = None
    position: int | None = None

    def __str__(self) -> str:
        where = f"session {self.session_id!r} " if self.session_id and self.session_id not in self.key else ""
        at = f"at event position {self.position} " if self.position is not None else ""
        return f"{self.table} {self.key}: {where}{at}field {self.field!r}: expected {self.expected!r}, found {self.found!r}"


@dataclass
class AuditReport:
    sessions: int = 0
    events: int = 0
    seconds: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)
    #: The stored projector checkpoint: read models are compared with a replay up to it.
    projected_through: int = 0

    @property
    def ok(self) -> bool:
        return not self.divergences


#: What replaying a damaged log can raise; reported as a divergence, not a crash.
REPLAY_FAILURES = (UnknownEventError, ProjectionError, LookupError, TypeError, ValueError)


async def audit(engine: AsyncEngine, *, on_progress: Callable[[str, int], None] | None = None) -> AuditReport:
    """Check the log, replay it up to the stored checkpoint in a scratch database, compare.

    Events appended after the stored checkpoint are checked but not compared: the stored read
    models have not seen them yet (run the projector first to audit them too). Audit a database
    whose projector is idle; one that advances meanwhile shows up as divergences.
    """
    started = time.perf_counter()
    report = AuditReport()
    async with engine.connect() as conn:
        report.projected_through = await rm.get_checkpoint(conn)
    report.divergences.extend(await check_log(engine, report, on_progress))
    scratch = create_engine("sqlite+aiosqlite://")
    try:
        await upgrade(scratch)
        try:
            await replay(
                engine, scratch, up_to=report.projected_through,
                on_events=(lambda n: on_progress("replayed", n)) if on_progress else None,
            )
        except REPLAY_FAILURES as error:
            found = " ".join(str(error).split()) or type(error).__name__
            report.divergences.append(Divergence("events", "replay", "projection", "a log the projector can replay", found))
        else:
            report.divergences.extend(await compare(scratch, engine))
    finally:
        await scratch.dispose()
    report.seconds = time.perf_counter() - started
    return report


@dataclass(frozen=True, slots=True)
class _Entry:
    """What the per-session checks need of one event (payloads are checked as they stream by)."""

    position: int
    version: int
    type: str
    placeholder: str | None  # SessionFailed's recorded decision
    problems: tuple[tuple[str, Any, Any], ...]  # (field, expected, found) found in the event itself


async def check_log(engine: AsyncEngine, report: AuditReport, on_progress: Callable[[str, int], None] | None) -> list[Divergence]:
    """Per-session invariants of the log: versions 1..n in position order, a SessionCreated first,
    one terminal event, a placeholder after each SessionFailed that emits one, readable types and
    schema versions, decodable payloads whose `trainable_tokens` agree with their mask.

    Divergences come in log order (by position).
    """
    found: list[Divergence] = []
    streams: dict[str, list[_Entry]] = {}
    async with engine.connect() as conn:
        result = await conn.stream(
            select(events_table.c.position, events_table.c.session_id, events_table.c.version, events_table.c.type,
                   events_table.c.data, events_table.c.payload, events_table.c.schema_version).order_by(events_table.c.position)
        )
        async for position, sid, version, type_, data, payload, schema in result:
            streams.setdefault(sid, []).append(_entry(position, version, type_, data, payload, schema))
            report.events += 1
            if on_progress is not None and report.events % 10_000 == 0:
                on_progress("checked", 10_000)
    report.sessions = len(streams)
    for sid, stream in streams.items():
        found.extend(_check_stream(sid, stream))
    found.sort(key=lambda d: d.position or 0)  # stable: a session's findings keep their order
    return found


def _entry(position: int, version: int, type_: str, data: Any, payload: bytes | None, schema: int) -> _Entry:
    problems: list[tuple[str, Any, Any]] = []
    decision = None
    payload = None if payload is None else bytes(payload)
    try:
        decoded = ev.upcast(type_, schema, data, payload)
    except UnknownEventError as error:
        problems.append(("type", "a known event type and schema version", str(error)))
        return _Entry(position, version, type_, None, tuple(problems))
    if type_ == "TrajectoryRecorded":
        try:
            arrays = tokens.decode(payload or b"", int(decoded["prompt_len"]), int(decoded["response_len"]), bool(decoded["has_logprobs"]))
        except (ValueError, KeyError, TypeError) as error:
            problems.append(("payload", "decodable token arrays", str(error)))
        else:
            stated = decoded.get("trainable_tokens")
            counted = int((arrays.response_mask == 1).sum())
            if stated is not None and stated != counted:
                problems.append(("trainable_tokens", counted, stated))
    elif type_ == "SessionFailed":
        decision = decoded.get("placeholder", "emit")
    return _Entry(position, version, type_, decision, tuple(problems))


def _check_stream(sid: str, stream: list[_Entry]) -> Iterable[Divergence]:
    def div(position: int, field_: str, expected: Any, found_: Any) -> Divergence:
        return Divergence("events", f"session {sid}", field_, expected, found_, sid, position)

    # In position order a session's versions are exactly 1, 2, …, n: a missing one is a gap, one
    # that appears elsewhere in the stream is out of order (e.g. two events' versions swapped).
    versions = {item.version for item in stream}
    for expected_version, item in enumerate(stream, start=1):
        if item.version != expected_version:
            field_ = "version order" if expected_version in versions else "version"
            yield div(item.position, field_, expected_version, item.version)
            return
    if stream[0].type != "SessionCreated":
        yield div(stream[0].position, "type", "SessionCreated", stream[0].type)
    terminal = [item for item in stream if item.type in TERMINAL]
    if len(terminal) > 1:
        yield div(terminal[1].position, "terminal events", 1, len(terminal))
    for index, item in enumerate(stream):
        for field_, expected, found_ in item.problems:
            yield div(item.position, field_, expected, found_)
        if item.type == "SessionFailed" and item.placeholder == "emit":
            following = stream[index + 1].type if index + 1 < len(stream) else None
            if following != "PlaceholderEmitted":
                yield div(item.position, "placeholder", "PlaceholderEmitted after SessionFailed", following)
        if terminal and item.position > terminal[0].position and item.type != "PlaceholderEmitted":
            yield div(item.position, "type", "nothing after the terminal event", item.type)


async def compare(expected_engine: AsyncEngine, found_engine: AsyncEngine) -> list[Divergence]:
    """Compare read models (surrogate ids and wall-clock columns excluded) and queue tensors."""
    out: list[Divergence] = []
    specs = [
        (sessions, ("session_id",), ()),
        (groups, ("run", "uid"), ()),
        (metric_counts, ("run", "partition", "global_step", "data_source", "metric"), ("id",)),
        (queue_rows, ("run", "partition", "key"), ("id",)),
    ]
    for table, keys, ignored in specs:
        expected = await _rows(expected_engine, table, keys)
        found = await _rows(found_engine, table, keys)
        out.extend(_diff(table.name, expected, found, ignored))
    out.extend(await _compare_queue_content(expected_engine, found_engine))
    return out


async def _rows(engine: AsyncEngine, table: Any, keys: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(select(table))
        return {tuple(row[k] for k in keys): dict(row) for row in result.mappings()}


def _normal(value: Any) -> Any:
    if hasattr(value, "tzinfo") and value.tzinfo is not None:
        return value.replace(tzinfo=None)  # SQLite keeps no zone; both sides are UTC
    return value


def _diff(name: str, expected: dict[tuple[Any, ...], dict[str, Any]], found: dict[tuple[Any, ...], dict[str, Any]], ignored: tuple[str, ...]) -> Iterable[Divergence]:
    for key in sorted(expected.keys() | found.keys(), key=repr):
        want, have = expected.get(key), found.get(key)
        label = "/".join("∅" if k is None else str(k) for k in key)
        sid = (want or have or {}).get("session_id")
        if want is None or have is None:
            yield Divergence(name, label, "(row)", "present" if want else "absent", "present" if have else "absent", sid)
            continue
        for column, value in want.items():
            if column in ignored:
                continue
            if _normal(value) != _normal(have.get(column)):
                position = want.get("terminal_position") or want.get("produced_position") or want.get("settled_position")
                yield Divergence(name, label, column, value, have.get(column), sid, position)


async def _compare_queue_content(expected_engine: AsyncEngine, found_engine: AsyncEngine) -> Iterable[Divergence]:
    """Hash each queue row's token arrays as the stored database resolves them."""
    expected = await _content_hashes(expected_engine)
    found = await _content_hashes(found_engine)
    out = []
    for key, digest in expected.items():
        if key in found and found[key] != digest:
            out.append(Divergence("queue_rows", "/".join(map(str, key)), "content sha256", digest, found[key]))
    return out


async def _content_hashes(engine: AsyncEngine) -> dict[tuple[Any, ...], str]:
    async with engine.connect() as conn:
        rows = [dict(r) for r in (await conn.execute(select(queue_rows).where(queue_rows.c.kind == "row"))).mappings()]
        sources = await rm.source_events(conn, [r["source_position"] for r in rows])
    out = {}
    for row in rows:
        source = sources.get(row["source_position"])
        digest = hashlib.sha256()
        if source is not None:
            type_, _schema, data, payload = source
            digest.update(type_.encode())
            digest.update(payload if payload is not None else repr(data.get("token_id")).encode())
        out[(row["run"], row["partition"], row["key"])] = digest.hexdigest()
    return out
