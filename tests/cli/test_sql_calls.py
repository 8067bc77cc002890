"""docs/sql.md's queries over model calls, run on a `demo --calls` run on SQLite and PostgreSQL.

Each documented query of the "Model calls" section is taken from the page as printed and run on
a demo run whose sessions record their model calls (docs/design.md §15); every number it returns
is checked against the same figure recomputed here from the `events` table (each
`ModelCallStarted` and the record or failure that answered it in its attempt, each session's
terminal event), never against the `model_calls` view the queries read. The demo itself is held
to what `--calls` promises: failed calls, calls left open by a session that died during one,
sessions that died between calls with their calls kept, sessions one version behind and sessions
spanning a weight update, the same calls again under the same seed, and the row of a succeeded
session assembled from its calls.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sessions import ConfigError, Ledger
from sessions.cli.demo import MAX_CALLS, DemoConfig, policies, run_demo
from sessions.cli.sql import run_query
from tests.cli.test_sql import calls_examples, cli
from tests.conftest import BACKENDS, fresh_database

RUN = "calls"
CONFIG = DemoConfig(
    steps=2, prompts=4, group_size=4, fail_rate=0.3, cancel_rate=0.05, seed=5, calls=4
)
QUERIES = {"by_outcome": 0, "latency": 1, "spanning": 2}


@dataclass
class Call:
    attempt: int
    call_id: str
    outcome: str = "open"
    latency_s: float | None = None
    min_version: int | None = None
    max_version: int | None = None
    prompt_tokens: int | None = None


@dataclass
class Session:
    session_id: str
    partition: str
    global_step: int | None
    state: str = "running"
    failure_reason: str | None = None
    attempt: int = 0
    calls: list[Call] = field(default_factory=list)
    #: the current attempt's calls by id: an answer settles only a call of its own attempt
    current: dict[str, Call] = field(default_factory=dict)


async def sessions_from_events(ledger: Ledger, run: str) -> dict[str, Session]:
    """Each session of `run` and its calls, folded from the raw log."""
    out: dict[str, Session] = {}
    async for page in ledger.store.iter_from(0):
        for e in page:
            if e.run != run or e.session_id.startswith("@"):
                continue
            s = out.setdefault(e.session_id, Session(e.session_id, e.partition, e.global_step))
            if e.type == "SessionStarted":
                s.attempt += 1
                s.current = {}
            elif e.type == "ModelCallStarted":
                call = Call(s.attempt, e.data["call_id"])
                s.calls.append(call)
                s.current[call.call_id] = call
            elif e.type in ("ModelCallRecorded", "ModelCallFailed"):
                call = s.current[e.data["call_id"]]
                call.outcome = "recorded" if e.type == "ModelCallRecorded" else "failed"
                call.latency_s = e.data.get("latency_s")
                if call.outcome == "recorded":
                    call.min_version = e.data["min_version"]
                    call.max_version = e.data["max_version"]
                    call.prompt_tokens = e.data["prompt_shared"] + e.data["prompt_len"]
            elif e.type == "SessionSucceeded":
                s.state = "succeeded"
            elif e.type == "SessionFailed":
                s.state, s.failure_reason = "failed", e.data["reason"]
            elif e.type == "SessionCancelled":
                s.state = "cancelled"
    return out


def nearest_rank(values: list[float], p: float) -> float:
    """The p-quantile by the nearest-rank rule: the ⌈p·n⌉-th smallest value."""
    ordered = sorted(values)
    return ordered[math.ceil(p * len(ordered)) - 1]


@pytest.fixture(scope="module", params=BACKENDS)
def demo_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One `demo --calls 4` run per backend for the module."""

    async def record(url: str) -> None:
        async with Ledger.open(url, run=RUN, **policies(CONFIG)) as ledger:  # type: ignore[arg-type]
            await run_demo(ledger, CONFIG)
            await ledger.project()

    with fresh_database(request.param, tmp_path_factory.mktemp("calls")) as url:
        asyncio.run(record(url))
        yield url


async def documented(ledger: Ledger, name: str) -> list[dict[str, Any]]:
    expected, sql = calls_examples()[QUERIES[name]]
    columns, rows = await run_query(ledger.engine, sql)
    assert [c.lower() for c in columns] == expected
    assert rows, f"docs/sql.md's {name} query returned no rows on a demo --calls run:\n{sql}"
    return [dict(zip(expected, row)) for row in rows]


def test_the_section_has_the_three_queries() -> None:
    assert len(calls_examples()) == len(QUERIES)


async def test_the_demo_records_what_calls_promise(demo_url: str) -> None:
    async with Ledger.open(demo_url, run=RUN) as ledger:
        sessions = await sessions_from_events(ledger, RUN)
    calls = [c for s in sessions.values() for c in s.calls]
    outcomes = Counter(c.outcome for c in calls)
    assert outcomes["recorded"] and outcomes["failed"] and outcomes["open"], outcomes
    died_between = [
        s
        for s in sessions.values()
        if s.failure_reason == "runner_error" and all(c.outcome != "open" for c in s.calls)
    ]
    assert died_between and all(
        0 < sum(c.outcome == "recorded" for c in s.calls) < CONFIG.calls for s in died_between
    )
    assert any(s.failure_reason == "sandbox_error" for s in sessions.values())
    for s in sessions.values():
        recorded = [c for c in s.calls if c.outcome == "recorded" and c.attempt == s.attempt]
        if s.state == "succeeded":  # every turn answered, each prompt the context before it
            assert len(recorded) == CONFIG.calls
            assert all(a.prompt_tokens < b.prompt_tokens for a, b in zip(recorded, recorded[1:]))
    versions = {
        (s.global_step, min(c.min_version for c in r), max(c.max_version for c in r))
        for s in sessions.values()
        if (r := [c for c in s.calls if c.outcome == "recorded"])
    }
    assert {(1, 1, 1), (1, 0, 0), (1, 0, 1), (0, 0, 0)} <= versions  # current, behind, spanning
    assert all(low >= step - 1 and high <= step for step, low, high in versions)


async def test_calls_per_session_by_outcome(demo_url: str) -> None:
    async with Ledger.open(demo_url, run=RUN) as ledger:
        sessions = await sessions_from_events(ledger, RUN)
        rows = await documented(ledger, "by_outcome")
    expected: dict[tuple[Any, ...], Counter[str]] = defaultdict(Counter)
    for s in sessions.values():
        counts = expected[(s.partition, s.state, s.failure_reason)]
        counts["sessions"] += 1
        counts.update(c.outcome for c in s.calls)
    assert {(r["partition"], r["state"], r["failure_reason"]) for r in rows} == set(expected)
    for r in rows:
        counts = expected[(r["partition"], r["state"], r["failure_reason"])]
        assert (r["sessions"], r["calls_recorded"], r["calls_failed"], r["calls_open"]) == (
            counts["sessions"],
            counts["recorded"],
            counts["failed"],
            counts["open"],
        ), r
        total = counts["recorded"] + counts["failed"] + counts["open"]
        assert math.isclose(r["calls_per_session"], total / counts["sessions"])
    assert {r["state"] for r in rows} >= {"succeeded", "failed"}


async def test_latency_p50_p99_by_step(demo_url: str) -> None:
    async with Ledger.open(demo_url, run=RUN) as ledger:
        sessions = await sessions_from_events(ledger, RUN)
        rows = await documented(ledger, "latency")
    latencies: dict[tuple[str, int | None], list[float]] = defaultdict(list)
    for s in sessions.values():
        for c in s.calls:
            if c.outcome == "recorded" and c.latency_s is not None:
                latencies[(s.partition, s.global_step)].append(c.latency_s)
    assert [(r["partition"], r["global_step"]) for r in rows] == sorted(latencies)
    for r in rows:
        values = latencies[(r["partition"], r["global_step"])]
        assert r["calls"] == len(values)
        assert math.isclose(r["latency_p50"], nearest_rank(values, 0.50), rel_tol=1e-12)
        assert math.isclose(r["latency_p99"], nearest_rank(values, 0.99), rel_tol=1e-12)
        assert math.isclose(r["latency_max"], max(values), rel_tol=1e-12)
        assert r["latency_p50"] <= r["latency_p99"] <= r["latency_max"]


async def test_sessions_that_spanned_a_weight_update(demo_url: str) -> None:
    async with Ledger.open(demo_url, run=RUN) as ledger:
        sessions = await sessions_from_events(ledger, RUN)
        rows = await documented(ledger, "spanning")
        staleness = {step: await ledger.metrics_dict("train", step) for step in range(CONFIG.steps)}
    spanning = {}
    for s in sessions.values():
        recorded = [c for c in s.calls if c.outcome == "recorded"]
        if recorded:
            low = min(c.min_version for c in recorded)  # type: ignore[type-var]
            high = max(c.max_version for c in recorded)  # type: ignore[type-var]
            if low < high:
                spanning[s.session_id] = (
                    s.partition,
                    s.global_step,
                    s.state,
                    low,
                    high,
                    len(recorded),
                )
    assert {
        r["session_id"]: (
            r["partition"],
            r["global_step"],
            r["state"],
            r["min_version"],
            r["max_version"],
            r["calls_recorded"],
        )
        for r in rows
    } == spanning
    assert [r["session_id"] for r in rows] == sorted(
        spanning, key=lambda sid: (spanning[sid][0], spanning[sid][1], sid)
    )
    # the batch's count of its rows that spanned an update: a train step's succeeded sessions
    for step, figures in staleness.items():
        succeeded = sum(
            1
            for p, k, state, *_ in spanning.values()
            if (p, k, state) == ("train", step, "succeeded")
        )
        assert figures.get("ledger/train/all/off_policy/rows_spanning_updates", 0.0) == succeeded


async def test_the_same_seed_records_the_same_calls(demo_url: str, tmp_path: Path) -> None:
    """A second run of the same settings: every session makes the same calls, token for token
    in its assembled row, with the same versions, latencies and outcomes."""

    async def calls_of(ledger: Ledger, run: str) -> dict[str, list[tuple[Any, ...]]]:
        _, rows = await run_query(
            ledger.engine,
            "SELECT session_id, attempt, call_id, turn, outcome, prompt_tokens, response_tokens, "
            "latency_s, min_version, max_version, finish_reason, server "
            f"FROM model_calls WHERE run = '{run}'",
        )
        out: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for row in rows:
            out[row[0].split("-", 1)[1]].append(tuple(row[1:]))
        return {sid: sorted(calls) for sid, calls in out.items()}

    def rows_of(batch: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The batch's rows as a multiset (their order is the order sessions ended in)."""
        pairs = zip(batch["responses"].tolist(), batch["response_mask"].tolist())
        return sorted((tuple(ids), tuple(mask)) for ids, mask in pairs)

    async with Ledger.open(demo_url, run="again", **policies(CONFIG)) as ledger:  # type: ignore[arg-type]
        await run_demo(ledger, CONFIG)
        await ledger.project()
        first, again = await calls_of(ledger, RUN), await calls_of(ledger, "again")
        # a cancelled session's calls are the cancel's timing (it lands 10 ms after the start)
        _, cancelled = await run_query(
            ledger.engine, "SELECT session_id FROM sessions WHERE state = 'cancelled'"
        )
        for (session_id,) in cancelled:
            (
                first.pop(session_id.split("-", 1)[1], None),
                again.pop(session_id.split("-", 1)[1], None),
            )
        assert first == again and len(first) > CONFIG.steps * CONFIG.prompts * CONFIG.group_size
        for step in range(CONFIG.steps):
            ours = rows_of(await ledger.batch("train", step))
            assert ours == rows_of(await ledger.batch("train", step, run=RUN))


def test_calls_join_the_runs_fingerprint_only_when_asked_for() -> None:
    """A run recorded before `--calls` existed keeps its fingerprint (and can be grown); a run
    with calls is another configuration (a rerun of `--run NAME` with other `--calls` is refused)."""
    plain = policies(DemoConfig())["config"]
    assert "calls" not in plain["demo"]  # type: ignore[index]
    assert policies(DemoConfig(calls=4))["config"] == {"demo": {**plain["demo"], "calls": 4}}  # type: ignore[index]
    with pytest.raises(ConfigError, match="--calls must be in"):
        DemoConfig(calls=MAX_CALLS + 1)


async def test_the_cli_flag_records_calls(tmp_path: Path) -> None:
    """`rollout-ledger demo --calls 2`: two calls per session reach the log through the verb."""
    db = str(tmp_path / "demo.db")
    code, _, err = await cli(
        "demo", "--db", db, "--steps", "1", "--prompts", "2", "--calls", "2", "--run", "flag",
        "--fail-rate", "0", "--cancel-rate", "0", cwd=tmp_path,
    )  # fmt: skip
    assert code == 0, err
    async with Ledger.open(db, migrate=False) as ledger:
        _, rows = await run_query(
            ledger.engine,
            "SELECT COUNT(DISTINCT session_id), SUM(CASE WHEN outcome = 'recorded' THEN 1 ELSE 0 END) "
            "FROM model_calls",
        )
    sessions = 2 * 2 * DemoConfig().group_size  # train and val, two prompts
    assert rows == [(sessions, 2 * sessions)]
