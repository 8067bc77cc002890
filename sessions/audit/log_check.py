"""The audit's checks of the log itself, in two streaming passes with bounded memory.

1. Content, in position order, one page at a time: every event's `data` parses as JSON, has a
   known type and schema version, upcasts, and has the fields its type needs (what the projector
   would refuse, found before the projector reaches it); a trajectory's payload has the size its
   lengths state and `trainable_tokens` agrees with its mask.
2. Structure, one session's stream at a time (in (session_id, version) order, which the unique
   index serves without sorting): versions 1..n in position order, a SessionCreated first, one
   terminal event, a placeholder after each SessionFailed that emits one, nothing else after the
   terminal event; a run's own stream (`@run:<run>`) holds `events.RUN_STREAM_EVENTS`
   events only.
3. Model calls: a trajectory assembled from calls (`from_calls`) is what the attempt's recorded
   calls assemble (`sessions.calls`), byte for byte, so a removed or altered call is found; the
   calls of sessions still open are held until their session ends.
4. Prunes: a payload is a tombstone only where its row's `pruned_by` names a prune (never by the
   bytes' shape: a token sequence that spells a tombstone is checked as tokens). A tombstone has
   the layout a prune writes, names the prune its row does, and states the length its event's
   lengths give; every `pruned_by` names a recorded `PayloadsPruned` whose steps hold the event
   before the record, and each prune's count, bytes and SHA-256 over its tombstones (in position
   order) are what it recorded. A recorded prune with none of its tombstones was cut between its
   record and its rewrite: the finding says to run `rollout-ledger prune` again to finish it.

Findings come back in log order (by position).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sessions import events as ev
from sessions import tokens
from sessions.audit.breaker_check import BreakerCheck
from sessions.audit.divergence import Divergence
from sessions.errors import UnknownEventError
from sessions.placeholder import EMIT
from sessions.projection.decoding import CACHED_TEXT, CURRENT, REQUIRED, parse_json
from sessions.runs import retention
from store import AsyncEngine, StoredEvent, StoredJSONError, driver, load_json
from store import bulk_read_models as bulk

__all__ = [
    "CONTENT_PAGE",
    "Finding",
    "TERMINAL",
    "check_log",
]

TERMINAL = ev.TERMINAL_EVENTS
#: Events per page of the content pass: the page's payloads are what it holds in memory.
CONTENT_PAGE = 1000
_STRUCTURE_PAGE = 20_000
_PROGRESS_EVERY = 10_000

# Ranks of findings at one position, as the checks of one stream report them: the stream's
# shape first, then what is wrong inside the event, then what is wrong with what follows it.
_SHAPE, _CONTENT, _SEQUENCE = 0, 1, 2

Finding = tuple[int, int, Divergence]  # position, rank, divergence


@dataclass
class _LogCheck:
    events: int = 0
    sessions: int = 0
    divergences: list[Divergence] = field(default_factory=list)


async def check_log(
    engine: AsyncEngine,
    *,
    on_progress: Callable[[str, int], None] | None = None,
    on_page: Callable[[list[tuple[Any, ...]]], Awaitable[None] | None] | None = None,
    page_text: bool = False,
) -> _LogCheck:
    """Both passes over the whole log; divergences sorted by position.

    `on_page` receives each page of the content pass as `sessions.projection.decoding.EVENT_COLUMNS` tuples,
    `data` already parsed where it parses: a caller folding the log shares this pass's reads.
    With `page_text`, `data` stays the stored text: a caller that ships pages to other processes
    pickles a string faster than the dict parsed from it.
    """
    result = _LogCheck()
    findings: list[Finding] = []
    prunes = _Prunes()
    calls = _Calls()
    breakers = BreakerCheck(_CONTENT)
    async with driver.reader(engine) as read:
        result.events = await _check_content(
            read, findings, on_progress, on_page, prunes, calls, breakers, page_text
        )
        result.sessions = await _check_structure(read, findings)
    findings.extend(prunes.findings())
    findings.sort(key=lambda f: (f[0], f[1]))  # stable: a stream's findings keep their order
    result.divergences = [d for _p, _r, d in findings]
    return result


# ---------------------------------------------------------------------------------- content
_CONTENT_COLUMNS = (
    "position",
    "session_id",
    "version",
    "type",
    "schema_version",
    "data",
    "payload",
    "recorded_at",
    "pruned_by",
    "run",
    "partition",
    "global_step",
)
#: Texts up to this long whose event checks clean are remembered per (type, schema version):
#: SessionStarted, most RewardPosted and SessionSucceeded data repeat across a log.
_REMEMBERED_TEXT = CACHED_TEXT
_REMEMBERED = 4096


async def _check_content(
    read: driver.Reader,
    findings: list[Finding],
    on_progress: Callable[[str, int], None] | None,
    on_page: Callable[[list[tuple[Any, ...]]], Awaitable[None] | None] | None,
    prunes: _Prunes,
    calls: _Calls,
    breakers: BreakerCheck,
    page_text: bool = False,
) -> int:
    count, reported = 0, 0
    clean: dict[tuple[str, int, str], Any] = {}
    async for rows in bulk.prefetched_pages(read, _CONTENT_COLUMNS, page_size=CONTENT_PAGE):
        folded = []
        for row in rows:
            position, sid, version, type_, schema, raw, payload, recorded_at, pruned_by = row[:9]
            short = type(raw) is str and len(raw) <= _REMEMBERED_TEXT
            remembered = (type_, schema, raw) if short else None
            data = clean.get(remembered) if remembered is not None else None
            if pruned_by is not None:
                prunes.tombstone(position, sid, payload, pruned_by, (row[9], row[10], row[11]))
                data = None  # a pruned payload is checked against its prune each time
            elif type_ == "PayloadsPruned":
                prunes.record(position, sid, raw, row[9])
            if data is None:
                data, problems = _inspect_event(
                    position, sid, version, type_, schema, raw, payload, pruned_by
                )
                for field_, expected, found in problems:
                    findings.append(
                        (
                            position,
                            _CONTENT,
                            Divergence(
                                "events", f"session {sid}", field_, expected, found, sid, position
                            ),
                        )
                    )
                if (
                    not problems
                    and remembered is not None
                    and type_ != "TrajectoryRecorded"
                    and len(clean) < _REMEMBERED
                ):
                    clean[remembered] = data
            if data is not None and type_ in _Calls.TYPES:
                kept = None if pruned_by is not None else payload  # a tombstone holds no tokens
                findings.extend(calls.see(position, sid, type_, schema, data, kept))
            if data is not None and type_ in BreakerCheck.TYPES:
                findings.extend(breakers.see(position, sid, type_, data, row[9]))
            # A short text goes to the fold as text: its decoder decodes each distinct one once.
            folded.append(
                (
                    position,
                    sid,
                    version,
                    type_,
                    schema,
                    raw if short or page_text or data is None else data,
                    recorded_at,
                )
            )
        if on_page is not None:
            fed = on_page(folded)
            if fed is not None:
                await fed
        count += len(rows)
        if on_progress is not None and count - reported >= _PROGRESS_EVERY:
            on_progress("checked", count - reported)
            reported = count
    return count


def _inspect_event(
    position: int,
    sid: str,
    version: int,
    type_: str,
    schema: int,
    raw: Any,
    payload: bytes | None,
    pruned_by: str | None = None,
) -> tuple[Any, list[tuple[str, Any, Any]]]:
    """One stored event's parsed data (None if it does not parse) and (field, expected, found)
    for what is wrong inside it; `pruned_by`: the prune its row says replaced its payload."""
    try:
        data = raw if isinstance(raw, dict) else parse_json(raw)
    except StoredJSONError as error:
        return None, [("data", "valid JSON", str(error))]
    payload = None if payload is None else bytes(payload)
    stone = None
    if pruned_by is not None:
        stone = retention.read_tombstone(payload)
        if stone is None or stone.prune_id != pruned_by:
            found = "bytes of another shape" if stone is None else f"one of prune {stone.prune_id}"
            return data, [("payload", f"the tombstone prune {pruned_by} wrote", found)]
        payload = None  # pruned: its length and digest are checked against the prune
    try:
        decoded = data if CURRENT.get(type_) == schema else ev.upcast(type_, schema, data, payload)
    except UnknownEventError as error:
        return data, [("type", "a known event type and schema version", str(error))]
    if not isinstance(decoded, dict):
        return data, [
            (
                "data",
                f"a JSON object of {type_} fields",
                f"event at position {position} ({type_} v{schema}) has malformed data: a JSON {type(decoded).__name__}",
            )
        ]
    if not REQUIRED[type_] <= decoded.keys():
        try:
            ev.decode(
                StoredEvent(
                    position,
                    "",
                    sid,
                    version,
                    type_,
                    schema,
                    "",
                    "",
                    "",
                    None,
                    decoded,
                    payload,
                    None,
                )
            )  # type: ignore[arg-type]
        except UnknownEventError as error:
            return data, [("data", f"the fields of {type_}", str(error))]
        return data, []  # pragma: no cover - decode refuses what lacks a required field
    if type_ == "TrajectoryRecorded" and stone is not None:
        return data, list(_tombstone_problems(decoded, stone))
    if type_ == "TrajectoryRecorded":
        return data, list(_payload_problems(decoded, payload))
    return data, []


def _payload_problems(
    decoded: dict[str, Any], payload: bytes | None
) -> Iterable[tuple[str, Any, Any]]:
    """The payload has the size the lengths state; the stated trainable count matches the mask.

    Counted with `bytes.count` over the mask (its trailing `response_len` bytes): the same as
    `tokens.decode(...).response_mask == 1`, without building arrays.
    """
    payload = payload or b""
    try:
        prompt_len, response_len = int(decoded["prompt_len"]), int(decoded["response_len"])
        has_logprobs = bool(decoded["has_logprobs"])
        if (
            len(payload) != tokens.payload_size(prompt_len, response_len, has_logprobs)
            or prompt_len < 0
            or response_len < 0
        ):
            tokens.decode(
                payload, prompt_len, response_len, has_logprobs
            )  # raises, naming the sizes
    except (ValueError, KeyError, TypeError) as error:
        yield ("payload", "decodable token arrays", str(error))
        return
    stated = decoded.get("trainable_tokens")
    counted = payload.count(1, len(payload) - response_len) if response_len else 0
    if stated is not None and stated != counted:
        yield ("trainable_tokens", counted, stated)


def _tombstone_problems(
    decoded: dict[str, Any], stone: retention.Tombstone
) -> Iterable[tuple[str, Any, Any]]:
    try:
        size = tokens.payload_size(
            int(decoded["prompt_len"]), int(decoded["response_len"]), bool(decoded["has_logprobs"])
        )
    except (ValueError, KeyError, TypeError) as error:
        yield ("payload", "lengths a pruned payload's size can be checked against", str(error))
        return
    if stone.length != size:
        yield ("pruned payload length", size, stone.length)


@dataclass
class _Tally:
    """A prune's tombstones as the content pass met them (bounded: no per-event state)."""

    count: int
    size: int
    chain: Any  # SHA-256 over the tombstones in position order
    first: tuple[int, str]  # position and session of the first
    last: tuple[int, str]  # position and session of the last
    steps: set[tuple[str, str, int | None]]  # (run, partition, step) of the events


class _Prunes:
    """Tombstones tallied per prune id (the rows' `pruned_by`) as the content pass meets them,
    and the recorded prunes."""

    def __init__(self) -> None:
        self.tally: dict[str, _Tally] = {}
        self.recorded: dict[str, tuple[int, str, str, dict[str, Any]]] = {}

    def tombstone(
        self,
        position: int,
        sid: str,
        payload: bytes | None,
        prune_id: str,
        step: tuple[str, str, int | None],
    ) -> None:
        payload = b"" if payload is None else bytes(payload)
        stone = retention.read_tombstone(payload)
        entry = self.tally.get(prune_id)
        if entry is None:
            entry = self.tally[prune_id] = _Tally(
                0, 0, hashlib.sha256(), (position, sid), (position, sid), set()
            )
        entry.count += 1
        entry.size += stone.length if stone is not None else 0
        entry.chain.update(payload)
        entry.last = (position, sid)
        entry.steps.add(step)

    def record(self, position: int, sid: str, raw: Any, run: str) -> None:
        try:
            data = raw if isinstance(raw, dict) else parse_json(raw)
            self.recorded[str(data["prune_id"])] = (position, sid, run, data)
        except (StoredJSONError, KeyError, TypeError):
            return  # the content check names unreadable data

    def findings(self) -> Iterable[Finding]:
        for prune_id, tally in self.tally.items():
            position, sid = tally.first
            if prune_id not in self.recorded:
                yield (
                    position,
                    _CONTENT,
                    Divergence(
                        "events",
                        f"session {sid}",
                        "payload",
                        "a payload, or the tombstone of a recorded prune",
                        f"a tombstone of prune {prune_id}, which the log does not record",
                        sid,
                        position,
                    ),
                )
            else:
                yield from self._outside(prune_id, tally)
        for prune_id, (position, sid, _run, data) in self.recorded.items():
            tally = self.tally.get(prune_id)
            if tally is None and data.get("events"):
                yield (
                    position,
                    _CONTENT,
                    Divergence(
                        "events",
                        f"session {sid}",
                        f"prune {prune_id}",
                        f"{data.get('events')} tombstones of its steps' payloads",
                        f"prune {prune_id} is incomplete: run `rollout-ledger prune` again to "
                        "finish it",
                        sid,
                        position,
                    ),
                )
                continue
            count, size, chain = (
                (tally.count, tally.size, tally.chain) if tally else (0, 0, hashlib.sha256())
            )
            found = {"events": count, "bytes": size, "digest": chain.hexdigest()}
            for name, value in found.items():
                if data.get(name) != value:
                    yield (
                        position,
                        _CONTENT,
                        Divergence(
                            "events",
                            f"session {sid}",
                            f"prune {prune_id} {name}",
                            data.get(name),
                            value,
                            sid,
                            position,
                        ),
                    )

    def _outside(self, prune_id: str, tally: _Tally) -> Iterable[Finding]:
        """A tombstone its prune does not cover: outside the recorded steps, or after the record."""
        position, sid, run, data = self.recorded[prune_id]
        try:
            covered = {(run, str(data["partition"]), int(s)) for s in data["steps"]}
        except (KeyError, TypeError, ValueError):
            return  # the content check names unreadable data
        where = (
            tally.last
            if tally.last[0] > position
            else next((tally.first for step in tally.steps if step not in covered), None)
        )
        if where is not None:
            yield (
                where[0],
                _CONTENT,
                Divergence(
                    "events",
                    f"session {where[1]}",
                    "payload",
                    f"a tombstone of prune {prune_id} on an event of its steps before its record "
                    f"(position {position})",
                    f"one outside them (steps {sorted(tally.steps, key=repr)[:3]})",
                    where[1],
                    where[0],
                ),
            )


# ------------------------------------------------------------------------------ model calls
class _Calls:
    """Each open session's recorded calls of its current attempt, to re-assemble the rows made
    from them; a session's are dropped when it ends (memory: the open sessions' calls)."""

    TYPES = frozenset({"ModelCallRecorded", "AttemptFailed", "TrajectoryRecorded", *TERMINAL})

    def __init__(self) -> None:
        self._recorded: dict[str, dict[str, ev.ModelCallRecorded | None]] = {}

    def see(
        self, position: int, sid: str, type_: str, schema: int, data: Any, payload: Any
    ) -> Iterable[Finding]:
        if type_ in TERMINAL:
            self._recorded.pop(sid, None)
        elif type_ == "AttemptFailed":
            self._recorded.pop(sid, None)
        elif type_ == "ModelCallRecorded":
            self._record(sid, data, payload)
        elif isinstance(data, dict) and data.get("from_calls"):
            yield from self._check_row(position, sid, data, payload)

    def _record(self, sid: str, data: Any, payload: Any) -> None:
        calls = self._recorded.setdefault(sid, {})
        call: ev.ModelCallRecorded | None = None
        if payload is not None:  # None: pruned, so its rows cannot be re-assembled
            try:
                call = ev.ModelCallRecorded.from_data(data, bytes(payload))
                call.arrays()  # a damaged payload (the content pass names it)
            except (TypeError, ValueError, KeyError):
                call = None
        if isinstance(data, dict) and isinstance(data.get("call_id"), str):
            calls[data["call_id"]] = call

    def _check_row(
        self, position: int, sid: str, data: dict[str, Any], payload: Any
    ) -> Iterable[Finding]:
        from sessions import calls as assembly

        def finding(expected: Any, found: Any) -> Finding:
            return (
                position,
                _CONTENT,
                Divergence(
                    "events", f"session {sid}", "from_calls", expected, found, sid, position
                ),
            )

        named = list(data["from_calls"])
        recorded = self._recorded.get(sid, {})
        missing = [c for c in named if c not in recorded]
        if missing:
            yield finding(
                f"recorded calls {', '.join(named)}", f"no record of {', '.join(missing)}"
            )
            return
        if any(recorded[c] is None for c in recorded):
            return  # a pruned call: nothing to re-assemble from (the prune check covers it)
        rows = [
            r for r in assembly.assemble([c for c in recorded.values() if c]) if r.call_ids == named
        ]
        if not rows:
            yield finding(
                f"a row of calls {', '.join(named)}", "the recorded calls make no such row"
            )
            return
        row = rows[0]
        made = tokens.encode(
            tokens.TokenArrays(row.prompt_ids, row.response_ids, row.response_mask, row.logprobs)
        )
        if payload is None:
            return  # pruned: the prune check covers its length and digest
        stored = bytes(payload)
        if made != stored or (row.min_version, row.max_version) != (
            data.get("min_version"),
            data.get("max_version"),
        ):
            yield finding(
                "the row its recorded calls assemble",
                f"a row that differs from calls {', '.join(named)} (tokens or versions)",
            )


# -------------------------------------------------------------------------------- structure
@dataclass(frozen=True, slots=True)
class _Entry:
    position: int
    version: int
    type: str
    placeholder: str | None  # SessionFailed's recorded decision (None where unreadable)


async def _check_structure(read: driver.Reader, findings: list[Finding]) -> int:
    sessions, after = 0, None
    sid: str | None = None
    stream: list[_Entry] = []
    while True:
        rows = await bulk.stream_order_page(read, after=after, limit=_STRUCTURE_PAGE)
        if not rows:
            break
        for row_sid, version, position, type_, failed_data, schema in rows:
            if row_sid != sid:
                if sid is not None:
                    findings.extend(_check_stream(sid, stream))
                    sessions += not sid.startswith(ev.RUN_STREAM_PREFIX)
                sid, stream = row_sid, []
            stream.append(_Entry(position, version, type_, _decision(type_, schema, failed_data)))
        after = (rows[-1][0], rows[-1][1])
    if sid is not None:
        findings.extend(_check_stream(sid, stream))
        sessions += not sid.startswith(ev.RUN_STREAM_PREFIX)
    return sessions


def _decision(type_: str, schema: int, raw: Any) -> str | None:
    if type_ != "SessionFailed":
        return None
    try:
        data = raw if isinstance(raw, dict) else load_json(raw)
        decoded = ev.upcast(type_, schema, data)
        return decoded.get("placeholder", EMIT)
    except (StoredJSONError, UnknownEventError, AttributeError):
        return None  # the content pass reports it


def _check_stream(sid: str, stream: list[_Entry]) -> Iterable[Finding]:
    """One session's events (any order in, checked in position order)."""
    stream.sort(key=lambda e: e.position)

    def div(position: int, rank: int, field_: str, expected: Any, found_: Any) -> Finding:
        return (
            position,
            rank,
            Divergence("events", f"session {sid}", field_, expected, found_, sid, position),
        )

    # In position order a session's versions are exactly 1, 2, …, n: a missing one is a gap, one
    # that appears elsewhere in the stream is out of order (e.g. two events' versions swapped).
    versions = {item.version for item in stream}
    for expected_version, item in enumerate(stream, start=1):
        if item.version != expected_version:
            field_ = "version order" if expected_version in versions else "version"
            yield div(item.position, _SHAPE, field_, expected_version, item.version)
            return
    if sid.startswith(ev.RUN_STREAM_PREFIX):  # a run's configuration stream holds nothing else
        for item in stream:
            if item.type not in ev.RUN_STREAM_EVENTS:
                yield div(
                    item.position,
                    _SHAPE,
                    "type",
                    f"{' or '.join(sorted(ev.RUN_STREAM_EVENTS))} (a run's stream)",
                    item.type,
                )
        return
    if stream[0].type != "SessionCreated":
        yield div(stream[0].position, _SHAPE, "type", "SessionCreated", stream[0].type)
    terminal = [item for item in stream if item.type in TERMINAL]
    if len(terminal) > 1:
        yield div(terminal[1].position, _SHAPE, "terminal events", 1, len(terminal))
    for index, item in enumerate(stream):
        if item.type == "SessionFailed" and item.placeholder == EMIT:
            following = stream[index + 1].type if index + 1 < len(stream) else None
            if following != "PlaceholderEmitted":
                yield div(
                    item.position,
                    _SEQUENCE,
                    "placeholder",
                    "PlaceholderEmitted after SessionFailed",
                    following,
                )
        if terminal and item.position > terminal[0].position and item.type != "PlaceholderEmitted":
            yield div(
                item.position, _SEQUENCE, "type", "nothing after the terminal event", item.type
            )
