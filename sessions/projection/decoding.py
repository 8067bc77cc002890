"""Stored events -> what the projection rules read: JSON `data` parsed, upcast and checked.

One decoder serves the incremental projector and the whole-log rebuild, so both refuse the same
logs with the same message. Payloads are never read: the rules need only the JSON data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sessions import events as ev
from sessions import storable
from sessions.errors import UnknownEventError
from sessions.projection.rules import LogEvent
from store import StoredEvent, load_json

__all__ = [
    "CACHED_TEXT",
    "CURRENT",
    "Decoder",
    "EVENT_COLUMNS",
    "REQUIRED",
    "parse_json",
]

#: The columns of `events` a decoder reads, in this order.
EVENT_COLUMNS = (
    "position",
    "session_id",
    "version",
    "type",
    "schema_version",
    "data",
    "recorded_at",
)

#: Data texts up to this long are decoded once per distinct text (at most _CACHED_ENTRIES per type):
#: a SessionStarted's, most RewardPosted's and SessionSucceeded's repeat across a log (a type
#: whose texts never repeat, as TrajectoryRecorded's, fills its cache once and stops).
CACHED_TEXT = 160
_CACHED_ENTRIES = 4096


def _required(cls: type[ev.Event]) -> frozenset[str]:
    """Fields `from_data` cannot fill with a default: their absence is malformed data."""
    missing = (dataclasses.MISSING,)
    return frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.default in missing and f.default_factory in missing and f.name != "payload"  # type: ignore[misc]
    )


CURRENT = {name: cls.SCHEMA_VERSION for name, cls in ev.EVENT_TYPES.items()}
REQUIRED = {name: _required(cls) for name, cls in ev.EVENT_TYPES.items()}


Problem = "tuple[str | None, str] | None"

#: What the decoder can find wrong with a stored event, besides a storable-value problem.
_DECODE_ERRORS = (UnknownEventError, ValueError, TypeError, KeyError)


class Decoder:
    """Turns rows of `EVENT_COLUMNS` into `LogEvent`s. Keeps a cache of short data texts, so use
    one decoder per pass over a log (the decoded dicts are shared: the rules never change them).

    Never raises for what one event holds: an event that does not decode, or whose values cannot
    be stored (`sessions.storable`), comes out with its problem, for the rules to quarantine."""

    def __init__(self) -> None:
        self._cache: dict[str, dict[str, tuple[dict[str, Any] | None, Problem]]] = {
            name: {} for name in CURRENT
        }

    def events(self, rows: Sequence[Sequence[Any]]) -> list[LogEvent]:
        out: list[LogEvent] = []
        caches, decode = self._cache, self._decode
        for row in rows:
            position, sid, version, type_, schema, raw, recorded_at = row
            cache = caches.get(type_) if schema == CURRENT.get(type_) else None
            hit = cache.get(raw) if cache is not None and type(raw) is str else None
            data, problem = hit if hit is not None else decode(row, cache)
            out.append((position, sid, version, type_, data, recorded_at, problem))
        return out

    def _decode(
        self, row: Sequence[Any], cache: dict[str, tuple[dict[str, Any] | None, Problem]] | None
    ) -> tuple[dict[str, Any] | None, Problem]:
        position, _sid, _version, type_, schema, raw, _at = row
        try:
            data = raw if type(raw) is dict else parse_json(raw)
            if CURRENT.get(type_) != schema:
                data = ev.upcast(
                    type_, schema, data, None
                )  # raises on unknown types and newer schemas
            if type(data) is not dict:
                raise UnknownEventError(
                    f"event at position {position} ({type_} v{schema}) has malformed data: not a JSON object"
                )
            if not REQUIRED[type_] <= data.keys():
                _raise_decode_error(row, data)
        except _DECODE_ERRORS as error:
            return None, (None, " ".join(str(error).split()) or type(error).__name__)
        try:
            data, found = storable.problems(type_, data)
        except _DECODE_ERRORS as error:  # a value of a shape no check foresaw
            return None, (None, f"{type(error).__name__}: {error}")
        result = (data, found[0] if found else None)
        if (
            cache is not None
            and type(raw) is str
            and len(raw) <= CACHED_TEXT
            and len(cache) < _CACHED_ENTRIES
        ):
            cache[raw] = result
        return result


#: `json.loads` by orjson where the two agree (store.stored_json): one decoder for every reader.
parse_json = load_json


def _raise_decode_error(row: Sequence[Any], data: dict[str, Any]) -> None:
    """Raise the error `ev.decode` raises for this event (one message for every reader of the log)."""
    position, sid, version, type_, schema, _raw, recorded_at = row
    stored = StoredEvent(
        position, "", sid, version, type_, schema, "", "", "", None, data, None, recorded_at
    )
    ev.decode(stored)
    raise UnknownEventError(
        f"event at position {position} ({type_} v{schema}) has malformed data"
    )  # pragma: no cover
