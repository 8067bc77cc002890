"""`export_dataset`: a run's terminal sessions as a Parquet or JSONL dataset, page by page.

The export reads the read models as of the projector's checkpoint when it starts (one consistent
cut, even of a run still being written: later events are left for the next export, and said so),
takes each exported trajectory's tokens from its `TrajectoryRecorded` payload (the log is the one
copy of every token), and writes one row group per page of sessions, so memory is bounded by a
page, never by the log. Failed sessions are rows like any other: a dataset that silently drops
them is the inflated average this library exists to prevent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

import numpy as np

from sessions import events as ev
from sessions import tokens, vocabulary
from sessions.errors import InvalidArgument, UnknownEventError
from sessions.export.schema import Column, columns_for
from sessions.export.writers import (
    FORMATS,
    ExportError,
    Page,
    check_destination,
    import_pyarrow,
    open_writer,
)
from store import AsyncEngine, check_schema, create_engine, export_reads, load_json, normalize_url
from store import read_models as rm

__all__ = ["ExportSummary", "Tokenizer", "export_dataset", "parse_steps"]

_PER = ("session", "trajectory")
TERMINAL = ("succeeded", "failed", "cancelled")
_DEFAULT_ROW_GROUP_SIZE = 1000


class Tokenizer(Protocol):
    """What `tokenizer=` needs: any object with `decode(list[int]) -> str` (a Hugging Face
    tokenizer is one), so the export never depends on a tokenizer library."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote, and what it left out and why (the CLI prints `lines()`)."""

    path: Path
    format: str
    per: str
    run: str
    rows: int
    #: exported sessions per state (succeeded / failed / cancelled)
    states: dict[str, int]
    #: sessions of the selection not terminal as of `checkpoint` (running, or ended in events not projected yet)
    open_sessions: int
    #: failed and cancelled sessions left out by `include_failed=False`
    excluded_failures: int
    #: the projector's checkpoint the export read up to, and the log's last position then
    checkpoint: int
    log_end: int
    #: trajectories whose data or payload could not be decoded (their token columns are null)
    undecodable: int
    bytes: int
    seconds: float
    columns: tuple[str, ...] = field(default=())

    @property
    def sessions(self) -> int:
        return sum(self.states.values())

    @property
    def behind(self) -> int:
        """Events in the log the export did not see (not projected when it began)."""
        return max(0, self.log_end - self.checkpoint)

    def lines(self) -> list[str]:
        states = ", ".join(f"{n} {s}" for s, n in self.states.items() if n) or "no sessions"
        unit = "session" if self.per == "session" else "trajectory"
        size = f"{self.bytes / 1e6:.1f} MB" if self.bytes >= 100_000 else f"{self.bytes:,} bytes"
        out = [
            f"wrote {self.rows} row(s), one per {unit} ({states}), of run {self.run!r} to {self.path} "
            f"({self.format}, {size}, {self.seconds:.2f}s)"
        ]
        if self.rows == 0:
            holds = "the columns and no rows" if self.format == "parquet" else "no lines"
            out.append(f"the export is empty (no terminal session matches): the file holds {holds}")
        if self.behind:
            out.append(
                f"note: exported as of the projector's checkpoint (position {self.checkpoint}); the log goes on to "
                f"{self.log_end} ({self.behind} event(s) not projected yet): run `rollout-ledger project` and export "
                "again to include them"
            )
        if self.open_sessions:
            out.append(
                f"note: left out {self.open_sessions} session(s) not terminal as of that checkpoint (still running, "
                "or ended in events not projected yet)"
            )
        if self.excluded_failures:
            out.append(
                f"note: left out {self.excluded_failures} failed or cancelled session(s) (successes only)"
            )
        if self.undecodable:
            out.append(
                f"warning: {self.undecodable} trajectory(ies) could not be decoded (damaged data or payload); "
                "their token columns are null — run `rollout-ledger audit`"
            )
        return out


def parse_steps(steps: Any) -> tuple[int | None, int | None]:
    """`steps` as (first, last), both included: N, (A, B) with None for an open end, or text
    'A:B', 'A:', ':B', 'N'. Inclusive because training steps are named, not sliced."""
    if steps is None:
        return None, None
    if isinstance(steps, bool):
        raise InvalidArgument(f"steps must be N, (A, B) or 'A:B', got {steps!r}")
    if isinstance(steps, int):
        low: Any = steps
        high: Any = steps
    elif isinstance(steps, str):
        text = steps.strip()
        first, colon, last = text.partition(":")
        try:
            low = int(first) if first.strip() else None
            high = (int(last) if last.strip() else None) if colon else low
        except ValueError:
            raise InvalidArgument(
                f"--steps {steps!r}: expected A:B (both included), A:, :B or N with integer steps, e.g. 0:9"
            ) from None
    elif isinstance(steps, tuple) and len(steps) == 2:
        low, high = steps
    else:
        raise InvalidArgument(f"steps must be N, (A, B) or 'A:B', got {steps!r}")
    for value in (low, high):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise InvalidArgument(f"steps {steps!r}: a step is an integer >= 0")
    if low is not None and high is not None and low > high:
        raise InvalidArgument(
            f"steps {steps!r}: the first step {low} is after the last {high} (A:B includes both ends)"
        )
    return low, high


def _check_options(
    format: str, per: str, run: str | None, partition: str | None, row_group_size: int
) -> None:
    if format not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if per not in _PER:
        raise ExportError(
            f"per must be 'session' (one row per session) or 'trajectory' (one per trajectory), got {per!r}"
        )
    if run is not None:  # None: the ledger's run, or the latest; never an empty name
        vocabulary.check_run(run)
    if partition is not None:  # None: both
        vocabulary.check_partition(partition)
    if (
        isinstance(row_group_size, bool)
        or not isinstance(row_group_size, int)
        or row_group_size < 1
    ):
        raise ExportError(f"row_group_size must be an integer >= 1, got {row_group_size!r}")


@asynccontextmanager
async def _engine_of(source: Any) -> AsyncIterator[tuple[AsyncEngine, str | None]]:
    """(engine, default run) for a Ledger, an engine, or a URL (opened and checked here)."""
    if isinstance(source, (str, Path)):
        engine = create_engine(normalize_url(str(source)))
        try:
            await check_schema(engine)
            yield engine, None
        finally:
            await engine.dispose()
        return
    engine = (
        source if isinstance(source, AsyncEngine) else getattr(source, "engine", None)
    )  # an AsyncEngine has a sync .engine
    if not isinstance(engine, AsyncEngine):
        raise ExportError(
            f"export_dataset reads a Ledger, an AsyncEngine or a database URL, got {type(source).__name__}"
        )
    yield engine, None if source is engine else getattr(source, "run", None)


async def export_dataset(
    source: Any,
    path: str | Path,
    *,
    format: str = "parquet",
    run: str | None = None,
    partition: str | None = None,
    steps: Any = None,
    include_failed: bool = True,
    per: str = "session",
    tokenizer: Tokenizer | None = None,
    row_group_size: int = _DEFAULT_ROW_GROUP_SIZE,
    on_progress: Callable[[int, int], None] | None = None,
) -> ExportSummary:
    """Write a run's terminal sessions to `path` as Parquet or JSONL; see docs/export.md.

    `source`: a `Ledger` (default run: the ledger's), an `AsyncEngine` or a URL (default run:
    the most recent). `steps`: N, (A, B) or 'A:B', both ends included. `include_failed=False`
    keeps succeeded sessions only. `per='trajectory'` writes one row per recorded trajectory.
    `tokenizer` (anything with `.decode(list[int]) -> str`) adds `prompt_text`/`response_text`.
    `on_progress(done, total)` is called after each page, in sessions. A run with no sessions
    raises; a selection that matches none writes an empty file (columns, no rows).
    """
    started = time.perf_counter()
    _check_options(format, per, run, partition, row_group_size)
    step_min, step_max = parse_steps(steps)
    path = Path(path)
    check_destination(path)
    if format == "parquet":
        import_pyarrow()  # before any reading: a missing extra is the first thing to fix
    async with _engine_of(source) as (engine, default_run), engine.connect() as conn:
        checkpoint, end = await export_reads.snapshot(conn)
        run = run or default_run or await rm.latest_run(conn)
        if run is None:
            raise ExportError(
                "the database has no events yet; record sessions (or run `rollout-ledger demo`) first"
            )
        if not await export_reads.run_has_events(conn, run):
            runs = await rm.recent_runs(conn, limit=10)
            named = f" (runs here: {', '.join(repr(r) for r in runs)})" if runs else ""
            raise ExportError(
                f"run {run!r} has no sessions in this database{named}; pass another run"
            )
        which = export_reads.SessionFilter(run, partition, step_min, step_max)
        counts = await export_reads.count_sessions(conn, which, checkpoint)
        states = TERMINAL if include_failed else ("succeeded",)
        total = sum(counts.get(s, 0) for s in states)
        table_columns = await export_reads.session_columns(conn)
        columns = columns_for(table_columns, text=tokenizer is not None)
        names = {col.name for col in columns}
        wanted = [c for c in table_columns if c in names]
        writer = open_writer(format, path, columns, row_group_size=row_group_size)
        exported = {s: 0 for s in states}
        rows = undecodable = done = 0
        after: tuple[str, str] | None = None
        # A page is written (Parquet: encoded and compressed, without the GIL) in a worker thread
        # while the next one is read: at most two pages are in memory at once.
        writing: asyncio.Future[None] | None = None
        try:
            while True:
                page = await export_reads.session_page(
                    conn,
                    which,
                    states=states,
                    up_to=checkpoint,
                    after=after,
                    limit=row_group_size,
                    columns=wanted,
                )
                if not page:
                    break
                after = (page[-1]["uid"], page[-1]["session_id"])
                built, bad = await _build_page(
                    conn, page, columns, checkpoint, per=per, tokenizer=tokenizer
                )
                n = len(built[columns[0].name])
                if writing is not None:
                    await writing
                    writing = None
                if n:
                    writing = asyncio.ensure_future(asyncio.to_thread(writer.write, built, n))
                rows += n
                undecodable += bad
                for row in page:
                    exported[row["state"]] += 1
                done += len(page)
                if on_progress is not None:
                    on_progress(done, total)
            if writing is not None:
                await writing
                writing = None
            size = writer.commit()
        except BaseException:
            if (
                writing is not None
            ):  # let the worker thread finish with the file before it is removed
                await asyncio.wait({writing})
                if not writing.cancelled():
                    writing.exception()  # retrieved: the error being raised is the one to report
            writer.abort()
            raise
    return ExportSummary(
        path=path,
        format=format,
        per=per,
        run=run,
        rows=rows,
        states=exported,
        open_sessions=counts.get("open", 0),
        excluded_failures=0
        if include_failed
        else counts.get("failed", 0) + counts.get("cancelled", 0),
        checkpoint=checkpoint,
        log_end=end,
        undecodable=undecodable,
        bytes=size,
        seconds=time.perf_counter() - started,
        columns=tuple(c.name for c in columns),
    )


# ------------------------------------------------------------------------------- one page
@dataclass
class _Trajectory:
    position: int
    data: dict[str, Any] | None  # None: the event's data could not be decoded

    @property
    def index(self) -> int | None:
        value = None if self.data is None else self.data.get("index")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _parse(type_: str, schema_version: int, raw: Any) -> dict[str, Any] | None:
    try:
        data = raw if isinstance(raw, dict) else load_json(raw)
        if not isinstance(data, dict):
            return None
        return ev.upcast(type_, schema_version, data)
    except (ValueError, TypeError, KeyError, UnknownEventError):
        return None


def _choose(
    state: str, recorded: list[_Trajectory], selected: Sequence[int] | None, per: str
) -> list[tuple[_Trajectory | None, bool | None]]:
    """The trajectories a session's rows carry, each with whether it entered a batch.

    Per session: a succeeded session's last selected trajectory; any other session's last
    recorded one (None when it recorded none). Per trajectory: every recorded one, in order, or
    one row without tokens for a session that recorded none.
    """
    chosen = set(selected or ()) if state == "succeeded" else set()
    if per == "trajectory":
        if not recorded:
            return [(None, None)]
        return [(t, t.index in chosen) for t in recorded]
    if not recorded:
        return [(None, None)]
    if chosen:
        picks = [t for t in recorded if t.index in chosen]
        if picks:
            return [(picks[-1], True)]
    return [(recorded[-1], False)]


def _arrays(trajectory: _Trajectory, payload: bytes | None) -> tokens.TokenArrays | None:
    data = trajectory.data
    if data is None or payload is None:
        return None
    try:
        return tokens.decode(
            payload, int(data["prompt_len"]), int(data["response_len"]), bool(data["has_logprobs"])
        )
    except (KeyError, TypeError, ValueError):
        return None


async def _build_page(
    conn: Any,
    page: list[dict[str, Any]],
    columns: Sequence[Column],
    up_to: int,
    *,
    per: str,
    tokenizer: Any,
) -> tuple[Page, int]:
    """The file's columns for one page of sessions, and how many trajectories did not decode."""
    recorded: dict[str, list[_Trajectory]] = {}
    selected: dict[str, Sequence[int]] = {}
    ids = [row["session_id"] for row in page]
    for position, sid, type_, schema_version, raw in await export_reads.trajectory_events(
        conn, ids, up_to
    ):
        data = _parse(type_, schema_version, raw)
        if type_ == "SessionSucceeded":
            picked = None if data is None else data.get("selected")
            selected[sid] = (
                [i for i in picked if isinstance(i, int)] if isinstance(picked, list) else []
            )
        else:
            recorded.setdefault(sid, []).append(_Trajectory(int(position), data))
    plan = [
        (row, t, sel)
        for row in page
        for t, sel in _choose(
            row["state"], recorded.get(row["session_id"], []), selected.get(row["session_id"]), per
        )
    ]
    blobs = await export_reads.payloads(conn, [t.position for _, t, _ in plan if t is not None])
    out: Page = {c.name: [] for c in columns}
    bad = 0
    for row, trajectory, in_batch in plan:
        arrays = None
        if trajectory is not None:
            arrays = _arrays(trajectory, blobs.get(trajectory.position))
            bad += arrays is None
        data = trajectory.data if trajectory is not None and trajectory.data is not None else {}
        values = _row_values(row, trajectory, data, arrays, in_batch, tokenizer)
        for name, column in out.items():
            column.append(values[name] if name in values else row.get(name))
    return out, bad


def _row_values(
    row: dict[str, Any],
    trajectory: _Trajectory | None,
    data: dict[str, Any],
    arrays: tokens.TokenArrays | None,
    in_batch: bool | None,
    tokenizer: Any,
) -> dict[str, Any]:
    trainable = data.get("trainable_tokens")
    if trainable is None and arrays is not None:
        trainable = int(np.count_nonzero(arrays.response_mask == 1))
    values: dict[str, Any] = {
        "reward_info": json.dumps(row.get("reward_info") or {}, sort_keys=True, ensure_ascii=False),
        "placeholder": bool(row.get("placeholder")),
        "trajectory_index": None if trajectory is None else trajectory.index,
        "selected": in_batch,
        "num_turns": data.get("num_turns"),
        "prompt_len": data.get("prompt_len"),
        "response_len": data.get("response_len"),
        "trainable_tokens": trainable,
        "prompt_ids": None if arrays is None else arrays.prompt_ids,
        "response_ids": None if arrays is None else arrays.response_ids,
        "response_mask": None if arrays is None else arrays.response_mask,
        "response_logprobs": None if arrays is None else arrays.logprobs,
    }
    if tokenizer is not None:
        values["prompt_text"] = (
            None if arrays is None else tokenizer.decode(arrays.prompt_ids.tolist())
        )
        values["response_text"] = (
            None if arrays is None else tokenizer.decode(arrays.response_ids.tolist())
        )
    return values
