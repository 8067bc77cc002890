"""Event envelopes as the store sees them: plain data, no domain knowledge."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson


def encode_data(data: Mapping[str, Any]) -> str:
    """An event's `data` as stored: compact JSON text, by orjson (a tenth of `json.dumps`' time,
    and the recorder encodes every event on the caller's loop).

    Where orjson refuses a value (an integer beyond 64 bits, a lone surrogate, a key that is not
    a string) the stdlib encodes it as it always did. Numbers must be finite, as JSON's are: the
    ledger refuses NaN and infinities before anything is encoded (`sessions.storable`), and
    orjson would write them as null.
    """
    try:
        return orjson.dumps(data).decode()
    except TypeError:
        return json.dumps(data)


@dataclass(slots=True)
class NewEvent:
    """An event about to be appended; `version` is assigned by the caller (expected + i).

    Treat it as immutable. It is not a frozen dataclass only because frozen construction costs
    a few microseconds per event on the recorder's hot path (every command builds these).
    """

    event_id: str
    session_id: str
    version: int
    type: str
    schema_version: int
    run: str
    uid: str
    partition: str
    global_step: int | None
    data: dict[str, Any]
    payload: bytes | None
    recorded_at: datetime
    #: `data` as stored: encoded once here, then reused by size caps and by the insert.
    data_json: str = field(default="", repr=False, compare=False)
    #: A creation's (session_index, group_size) in its group (run, partition, global_step, uid):
    #: the store refuses a taken index or another group size (`store.log.append_sql.GroupSlots`).
    slot: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.data_json:
            self.data_json = encode_data(self.data)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event read back from the log, with its global `position`."""

    position: int
    event_id: str
    session_id: str
    version: int
    type: str
    schema_version: int
    run: str
    uid: str
    partition: str
    global_step: int | None
    data: dict[str, Any] = field(repr=False)
    payload: bytes | None = field(repr=False)
    recorded_at: datetime
