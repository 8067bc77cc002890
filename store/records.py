"""Event envelopes as the store sees them: plain data, no domain knowledge."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event about to be appended; `version` is assigned by the caller (expected + i)."""

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
