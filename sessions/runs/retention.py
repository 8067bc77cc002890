"""What a run keeps and what its prunes left: the `RetentionPolicy`, the tombstone that stands in
for a pruned payload, the `PayloadsPruned` records as read back, and `check_pruned` for a batch.

Each pruned event's payload is replaced by a 64-byte tombstone holding the original payload's
length and SHA-256 and the prune's id (docs/decisions.md, "Retention"), and its row is marked
`pruned_by` the prune: that column, never the bytes' shape, says a payload is a tombstone, so no
token sequence can be taken for one (revision 0008). The event's JSON `data` is never rewritten. Each pruned step gets a `PayloadsPruned` event in the run's own stream
(`@run:<run>`) naming the steps, when, how many events and bytes, and the SHA-256 over its
tombstones in position order, so `audit` can prove every tombstone is one a recorded prune wrote.
The prune itself is `sessions.runs.pruning`.

A run's retention policy (`RetentionPolicy`, `LedgerConfig.retention`) is part of its recorded
configuration, so `prune(policy=True)` and a replay read it from the log.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessions.errors import BatchPruned, ConfigError
from sessions.runs.fingerprint import run_stream
from store import AsyncEngine, load_json
from store import retention as sql

__all__ = [
    "PruneRecord",
    "RetentionPolicy",
    "TOMBSTONE_SIZE",
    "Tombstone",
    "check_pruned",
    "make_tombstone",
    "prune_records",
    "read_tombstone",
    "recorded_policy",
]

_MAGIC = b"\x00RLPRUN\x01"
_LAYOUT = struct.Struct("<8s16sQ32s")  # magic, prune id, original length, SHA-256
TOMBSTONE_SIZE = _LAYOUT.size  # 64


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
    """The fields of the tombstone a prune wrote in place of a payload — call it only on a row
    whose `pruned_by` names a prune; None if the bytes are not a tombstone's layout (damage)."""
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
    """One `PayloadsPruned` event as read back: its tombstones are the payloads of its steps
    recorded before `position` (a pruned step is closed, docs/design.md §14)."""

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
