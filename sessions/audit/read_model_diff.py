"""Compare two databases' read models as key-ordered streams: the audit's last step.

Both sides are read at driver level in the same key order (PostgreSQL told to sort strings by
byte and NULLs first, as SQLite does) and merged like a join, so memory stays at one chunk per
side. Raw tuples are compared first; only a row that differs raw is typed (`store.read_model_scan`)
and compared column by column, so text that encodes equal values is no divergence.

The expected side may also be rows in memory (`compare_rows`): the audit's rebuilt read models,
as a SQLite database would hand them back, sorted here in that same order — no scratch database
to migrate, fill and read back.

Queue-row content (the token arrays a row's `source_position` resolves to) is hashed only where
it can differ: when both sides resolve it in one log (`sources`), only for rows that point at
different events; otherwise for every row, each side in its own log.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from sessions.audit.divergence import Divergence
from store import READ_MODEL_KEYS, TableScan, driver, scan
from store import bulk_read_models as bulk
from store import read_models as rm

__all__ = [
    "CHUNK",
    "compare",
    "compare_rows",
]

CHUNK = 5000
_DIGEST_CHUNK = 500


async def compare(
    expected_engine: Any, found_engine: Any, *, sources: Any | None = None
) -> list[Divergence]:
    """Divergences of `found_engine`'s read models from `expected_engine`'s, table by table, then
    queue-row content. `sources`: the database whose events resolve queue-row content for both
    sides (one side's database may hold no log); None resolves each side in its own."""
    return await _compare(expected_engine, None, found_engine, sources)


async def compare_rows(
    expected: Mapping[str, Sequence[Sequence[Any]]], found_engine: Any, *, sources: Any
) -> list[Divergence]:
    """`compare` with the expected read models in memory: per table, rows in its column order as
    SQLite's driver returns them (`store.bulk_read_models.prepare` for a SQLite target makes
    them), in any order. `sources` resolves queue-row content for both sides."""
    return await _compare(bulk.sqlite_shape(), expected, found_engine, sources)


async def _compare(
    expected_engine: Any,
    expected_rows: Mapping[str, Sequence[Sequence[Any]]] | None,
    found_engine: Any,
    sources: Any | None,
) -> list[Divergence]:
    out: list[Divergence] = []
    pointers: list[tuple[str, int | None, int | None]] = []
    for table, keys in READ_MODEL_KEYS:
        rows = None if expected_rows is None else expected_rows.get(table, ())
        out.extend(
            await _diff_table(
                expected_engine, found_engine, table, keys, pointers, sources is None, rows
            )
        )
    out.extend(await _content(expected_engine, found_engine, sources, pointers))
    return out


def _order_key(values: Iterable[Any]) -> tuple[tuple[int, Any], ...]:
    """Python order equal to the SQL order above: NULLs first, strings by code point (= UTF-8 bytes)."""
    return tuple((0, 0) if v is None else (1, v) for v in values)


class _Chunks:
    """One side's rows, read a chunk at a time, with a cursor into the current chunk; `rows`
    already sorted in key order stand in for a database's."""

    def __init__(self, engine: Any, sql: str, rows: Sequence[Sequence[Any]] | None = None) -> None:
        self._context = driver.reader(engine) if rows is None else None
        self._sql = sql
        self._given = rows
        self._chunks: AsyncIterator[list[Sequence[Any]]] | None = None
        self.rows: list[Sequence[Any]] = []
        self.at = 0

    async def __aenter__(self) -> _Chunks:
        if self._context is None:
            self._chunks = _in_chunks(self._given or ())
        else:
            read = await self._context.__aenter__()
            self._chunks = read.stream(self._sql, chunk=CHUNK)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        if self._context is not None:
            await self._context.__aexit__(*exc)

    async def ready(self) -> bool:
        """Whether a row is at the cursor (reading the next chunk if this one is used up)."""
        if self.at >= len(self.rows):
            assert self._chunks is not None
            self.rows, self.at = await anext(self._chunks, []), 0
        return self.at < len(self.rows)


async def _in_chunks(rows: Sequence[Sequence[Any]]) -> AsyncIterator[list[Sequence[Any]]]:
    """Rows in memory as a stream of chunks, as `driver.Reader.stream` hands a table's."""
    for start in range(0, len(rows), CHUNK):
        yield list(rows[start : start + CHUNK])


def _sorted(rows: Sequence[Sequence[Any]], key_at: tuple[int, ...]) -> list[Sequence[Any]]:
    """Rows in the scans' key order (`_order_key`: NULLs first, strings by code point); keys
    without a NULL compare as they are, so those sort by a key picked in C."""
    pick = operator.itemgetter(*key_at) if len(key_at) > 1 else (lambda row: (row[key_at[0]],))
    if not any(None in pick(row) for row in rows):
        return sorted(rows, key=pick)
    return sorted(rows, key=lambda row: _order_key(row[i] for i in key_at))


async def _merged(
    want: _Chunks,
    have: _Chunks,
    key_at: tuple[int, ...],
    same: Callable[[Sequence[Any], Sequence[Any]], bool],
    on_equal: Callable[[Sequence[Sequence[Any]], Sequence[Sequence[Any]]], None],
) -> AsyncIterator[tuple[Sequence[Any] | None, Sequence[Any] | None]]:
    """Pairs of rows with equal keys that differ, and (row, None) or (None, row) where one side
    lacks a key. Runs of rows equal on both sides are skipped a slice at a time (`on_equal` sees
    them): on an untouched database that is every row, compared in C."""
    while True:
        has_want, has_have = await want.ready(), await have.ready()
        if not has_want and not has_have:
            return
        if has_want and has_have:
            n = min(len(want.rows) - want.at, len(have.rows) - have.at)
            left, right = want.rows[want.at : want.at + n], have.rows[have.at : have.at + n]
            if same(left, right):
                on_equal(left, right)
                want.at += n
                have.at += n
                continue
            a, b = want.rows[want.at], have.rows[have.at]
            ka, kb = _order_key(a[i] for i in key_at), _order_key(b[i] for i in key_at)
            if ka == kb:
                on_equal([a], [b])
                want.at += 1
                have.at += 1
                yield a, b
            elif ka < kb:
                want.at += 1
                yield a, None
            else:
                have.at += 1
                yield None, b
        elif has_want:
            want.at += 1
            yield want.rows[want.at - 1], None
        else:
            have.at += 1
            yield None, have.rows[have.at - 1]


def _normal(value: Any) -> Any:
    """A value as both backends can hold it: datetimes without their (UTC) zone, and JSON numbers as
    floats — PostgreSQL's jsonb prints an integral float such as 1e300 as an integer."""
    if hasattr(value, "tzinfo") and value.tzinfo is not None:
        return value.replace(tzinfo=None)  # SQLite keeps no zone; both sides are UTC
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # beyond any float: both backends keep it exactly
            return value
    return value


async def _diff_table(
    expected_engine: Any,
    found_engine: Any,
    table: str,
    keys: tuple[str, ...],
    pointers: list[tuple[str, int | None, int | None]],
    all_pointers: bool,
    expected_rows: Sequence[Sequence[Any]] | None = None,
) -> list[Divergence]:
    expected_side: TableScan = scan(expected_engine, table, keys)
    found_side = scan(found_engine, table, keys)
    same_dialect = expected_engine.dialect.name == found_engine.dialect.name
    key_at = tuple(expected_side.columns.index(k) for k in keys)
    is_queue = table == "queue_rows"
    kind_at = expected_side.columns.index("kind") if is_queue else -1
    source_at = expected_side.columns.index("source_position") if is_queue else -1
    out: list[Divergence] = []

    def same(left: Sequence[Sequence[Any]], right: Sequence[Sequence[Any]]) -> bool:
        return same_dialect and left == right

    def on_equal(left: Sequence[Sequence[Any]], right: Sequence[Sequence[Any]]) -> None:
        if is_queue:  # rows resolved in one log matter only where they point at different events
            pointers.extend(
                (_label(w, key_at), w[source_at], h[source_at])
                for w, h in zip(left, right)
                if w[kind_at] == "row" and (all_pointers or w[source_at] != h[source_at])
            )

    given = None if expected_rows is None else _sorted(expected_rows, key_at)
    async with (
        _Chunks(expected_engine, expected_side.sql, given) as want_rows,
        _Chunks(found_engine, found_side.sql) as have_rows,
    ):
        async for want, have in _merged(want_rows, have_rows, key_at, same, on_equal):
            row = want if want is not None else have
            assert row is not None
            label = _label(row, key_at)
            if want is None or have is None:
                sid = (
                    row[expected_side.columns.index("session_id")]
                    if "session_id" in expected_side.columns
                    else None
                )
                out.append(
                    Divergence(
                        table,
                        label,
                        "(row)",
                        "present" if want else "absent",
                        "present" if have else "absent",
                        sid,
                    )
                )
                continue
            typed_want, typed_have = expected_side.typed(want), found_side.typed(have)
            for column, value in typed_want.items():
                if _normal(value) != _normal(typed_have[column]):
                    position = (
                        typed_want.get("terminal_position")
                        or typed_want.get("produced_position")
                        or typed_want.get("settled_position")
                    )
                    out.append(
                        Divergence(
                            table,
                            label,
                            column,
                            value,
                            typed_have[column],
                            typed_want.get("session_id"),
                            position,
                        )
                    )
    return out


def _label(row: Sequence[Any], key_at: tuple[int, ...]) -> str:
    return "/".join("∅" if row[i] is None else str(row[i]) for i in key_at)


async def _content(
    expected_engine: Any,
    found_engine: Any,
    sources: Any | None,
    pointers: list[tuple[str, int | None, int | None]],
) -> list[Divergence]:
    """Hash each compared queue row's token arrays as its side's log resolves them."""
    if sources is not None:
        pointers = [p for p in pointers if p[1] != p[2]]  # one log: equal positions, equal content
        if not pointers:
            return []
        want_hashes = have_hashes = await _digests(
            sources, [p for _l, a, b in pointers for p in (a, b)]
        )
    else:
        want_hashes = await _digests(expected_engine, [a for _l, a, _b in pointers])
        have_hashes = await _digests(found_engine, [b for _l, _a, b in pointers])
    out = []
    for label, want, have in pointers:
        digest, found = want_hashes[want], have_hashes[have]
        if digest != found:
            out.append(Divergence("queue_rows", label, "content sha256", digest, found))
    return out


async def _digests(engine: Any, positions: list[int | None]) -> dict[int | None, str]:
    """position -> digest; payloads are read a chunk at a time and only the digests kept."""
    wanted = sorted({p for p in positions if p is not None})
    out: dict[int | None, str] = {None: hashlib.sha256().hexdigest()}
    for start in range(0, len(wanted), _DIGEST_CHUNK):
        chunk = wanted[start : start + _DIGEST_CHUNK]
        sources = await rm.read_source_events(engine, chunk)
        for position in chunk:
            digest = hashlib.sha256()
            source = sources.get(position)
            if source is not None:
                type_, _schema, data, payload = source
                digest.update(type_.encode())
                digest.update(
                    payload if payload is not None else repr(data.get("token_id")).encode()
                )
            out[position] = digest.hexdigest()
    return out
