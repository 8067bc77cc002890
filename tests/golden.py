"""Golden event logs: fixed `events` tables kept as JSON Lines under tests/fixtures/ (docs/design.md §9).

One line per event, every column of the `events` table: `payload` base64 (or null), `recorded_at`
ISO 8601 with its UTC offset, the rest as stored. A golden log is loaded *verbatim* — positions,
event ids and schema versions included — into a fresh, migrated database, so replay and audit see
exactly the bytes an older rollout-ledger wrote.

The files are written only by `tests/fixtures/make_golden.py` (see its docstring), never by tests.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from store import read_models as rm
from store.dialects import WRITE_LOCK
from store.log.records import StoredEvent
from store.schema.migrate import upgrade
from store.schema.tables import events, groups, projection_errors, queue_rows

FIXTURES = Path(__file__).resolve().parent / "fixtures"
COLUMNS = tuple(c.name for c in events.c)

#: Metrics recorded in the expectation files (per scope): the headline figures and the counts
#: that a wrong fold of any event type would move.
EXPECTED_METRICS = (
    "sessions/total",
    "sessions/succeeded",
    "sessions/failed",
    "sessions/cancelled",
    "placeholders",
    "groups/total",
    "groups/finished",
    "groups/failure",
    "reward/absent",
    "rows/total",
    "reward/mean",
    "reward/mean_success_only",
    "reward/mean_per_uid",
    "reward/uids_excluded",
    "response_length/max",
)


#: The newest golden log's version, and the schema of every event type that had moved past 1 when
#: it was recorded. A schema bump without a new golden log (and a new entry here) fails
#: `test_the_newest_golden_log_is_what_todays_recorder_writes`.
#: v1: the seed's events; v2: TrajectoryRecorded gained `trainable_tokens`; v3:
#: SessionFailed gained origin / metric / partial selection, PlaceholderEmitted its lengths, and
#: the log gained AttemptFailed and RunConfigured; v4: SessionCreated gained `launch` (the run's
#: launch that created it), TrajectoryRecorded gained versions and `from_calls`, and the log
#: gained RunLaunched and the model-call events.
LOG_VERSION = 5
LOG_SCHEMAS = {
    "SessionCreated": 2,
    "TrajectoryRecorded": 3,
    "SessionFailed": 3,
    "PlaceholderEmitted": 2,
}


def golden_logs() -> list[Path]:
    """Every golden log, oldest schema first."""
    return sorted(FIXTURES.glob("golden_v*.jsonl"))


#: `events` columns added after the golden logs were written (revision 0004: a creation's slot).
ADDED_LATER = ("session_index", "group_size")
#: Revision 0008's mark of a pruned payload: NULL in a log that was never pruned.
PRUNE_MARK = ("pruned_by",)


def expectation_path(log: Path) -> Path:
    return log.with_name(log.name.removesuffix(".jsonl") + ".expected.json")


# ------------------------------------------------------------------ file format
def to_line(row: dict[str, Any]) -> str:
    """One `events` row as a JSON line (columns in table order)."""
    out: dict[str, Any] = {}
    for name in COLUMNS:
        value = row[name]
        if name == "payload":
            value = None if value is None else base64.b64encode(bytes(value)).decode("ascii")
        elif name == "recorded_at":
            value = value.isoformat()
        out[name] = value
    return json.dumps(out, sort_keys=False, separators=(",", ":"), allow_nan=False)


def from_line(line: str) -> dict[str, Any]:
    """A JSON line back to an `events` row (bytes payload, aware datetime)."""
    raw = json.loads(line)
    for name in ADDED_LATER + PRUNE_MARK:  # a log written before these columns: NULL there
        raw.setdefault(name, None)
    missing = set(COLUMNS) - raw.keys()
    if missing:
        raise ValueError(f"golden line lacks columns {sorted(missing)}: {line[:120]}")
    row = {name: raw[name] for name in COLUMNS}
    if row["payload"] is not None:
        row["payload"] = base64.b64decode(row["payload"])
    row["recorded_at"] = datetime.fromisoformat(row["recorded_at"])
    if row["recorded_at"].tzinfo is None:
        raise ValueError(
            f"golden line at position {row['position']}: recorded_at has no UTC offset"
        )
    return row


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [
        from_line(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
    ]


#: The `events` columns a `StoredEvent` carries (the slot columns are the store's, not the reader's).
STORED_FIELDS = tuple(f.name for f in dataclasses.fields(StoredEvent))


def stored_events(path: Path) -> list[StoredEvent]:
    """The golden log as the store would hand it back (for decoding without a database)."""
    return [StoredEvent(**{name: row[name] for name in STORED_FIELDS}) for row in read_rows(path)]


# ------------------------------------------------------------------ databases
async def load_golden(engine: AsyncEngine, path: Path) -> int:
    """Migrate `engine`'s empty database and insert the golden log verbatim; returns the count."""
    rows = read_rows(path)
    await upgrade(engine)
    async with engine.connect() as conn:
        if (await conn.execute(select(func.count()).select_from(events))).scalar_one():
            raise ValueError(f"cannot load {path.name}: the database already has events")
    async with engine.connect() as conn:
        conn = await conn.execution_options(**{WRITE_LOCK: True})
        async with conn.begin():
            await conn.execute(events.insert(), rows)
    if engine.dialect.name == "postgresql" and rows:
        async with (
            engine.begin() as conn
        ):  # explicit positions bypass the identity: move it past them
            await conn.execute(
                text("SELECT setval(pg_get_serial_sequence('events', 'position'), :p)"),
                {"p": max(r["position"] for r in rows)},
            )
    return len(rows)


async def dump_rows(engine: AsyncEngine) -> list[dict[str, Any]]:
    """The whole `events` table in position order."""
    async with engine.connect() as conn:
        result = await conn.execute(select(events).order_by(events.c.position))
        return [dict(row) for row in result.mappings()]


async def projection_summary(engine: AsyncEngine) -> dict[str, Any]:
    """What an expectation file pins: queue order, group tags and a few metric values."""
    async with engine.connect() as conn:
        queue = [
            dict(r)
            for r in (await conn.execute(select(queue_rows).order_by(queue_rows.c.id))).mappings()
        ]
        group_rows = [
            dict(r)
            for r in (
                await conn.execute(
                    select(groups).order_by(
                        groups.c.run, groups.c.partition, groups.c.global_step, groups.c.uid
                    )
                )
            ).mappings()
        ]
        quarantined = [
            dict(r)
            for r in (
                await conn.execute(select(projection_errors).order_by(projection_errors.c.position))
            ).mappings()
        ]
        metrics = await rm.metric_rows(conn)
    scoped: dict[str, dict[str, float]] = {}
    for row in metrics:
        if row["metric"] in EXPECTED_METRICS or row["metric"].startswith(
            ("reward/mean@", "failed/")
        ):
            scope = (
                f"{row['run']}/{row['partition']}/{row['global_step']}/{row['data_source'] or '*'}"
            )
            scoped.setdefault(scope, {})[row["metric"]] = row["value"]
    return {
        "queue": [
            {
                "partition": q["partition"],
                "global_step": q["global_step"],
                "kind": q["kind"],
                "key": q["key"],
                "session_id": q["session_id"],
                "source_position": q["source_position"],
                "reward": q["reward"],
                "is_placeholder": q["is_placeholder"],
            }
            for q in queue
        ],
        "group_tags": {q["key"]: q["tags"]["status"] for q in queue if q["kind"] == "tag"},
        "groups": {
            g["uid"]: {
                "status": g["status"],
                "settled_position": g["settled_position"],
                "members": g["members"],
            }
            for g in group_rows
        },
        "projection_errors": [
            {
                "position": e["position"],
                "type": e["type"],
                "field": e["field"],
                "outcome": e["outcome"],
            }
            for e in quarantined
        ],
        "metrics": {
            scope: dict(sorted(values.items())) for scope, values in sorted(scoped.items())
        },
    }
