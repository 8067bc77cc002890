"""The OpenTelemetry follower: sessions sent as they end, from a checkpoint that survives a kill.

A "kill" is an exception the follower does not catch, raised at the two points a real kill can
land that matter: after a page's checkpoint committed (nothing may be repeated or lost), and
after a page was sent but before its checkpoint committed (that page is sent again, with the same
ids). Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install -e '.[otel]'")

from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from sqlalchemy import text  # noqa: E402

from sessions import Ledger  # noqa: E402
from sessions.otel import attributes as A  # noqa: E402
from sessions.otel.follower import FollowedPage, follow_otel  # noqa: E402
from store import otel_follower  # noqa: E402
from tests.otel.recording import RUN, record_call_step  # noqa: E402

PAGE = 3


class Killed(BaseException):
    """Stands for the process dying: nothing in the follower catches it."""


def _roots(spans: list[Any]) -> list[str]:
    return [s.attributes[A.SESSION_ID] for s in spans if s.parent is None]


async def _terminal(ledger: Ledger) -> set[str]:
    async with ledger.engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT session_id FROM sessions WHERE state IN ('succeeded', 'failed', "
                "'cancelled')"
            )
        )
        return {row[0] for row in rows}


async def _wait_until(condition: Callable[[], bool], *, deadline_s: float = 120.0) -> None:
    """Wait for `condition` (checked as the loop turns), or fail after the deadline."""
    until = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < until, "the condition did not hold before the deadline"
        await asyncio.sleep(0.02)


async def test_a_follower_killed_after_a_checkpoint_resumes_without_gaps_or_repeats(
    db_url: str,
) -> None:
    async with Ledger.open(db_url, run=RUN) as ledger:
        for step in range(3):
            await record_call_step(ledger, step=step, prefix=f"s{step}")
        await ledger.project()
        exporter = InMemorySpanExporter()
        pages: list[FollowedPage] = []

        def die_after_two(page: FollowedPage) -> None:
            pages.append(page)
            if len(pages) == 2:
                raise Killed

        with pytest.raises(Killed):
            await follow_otel(ledger, exporter, page_size=PAGE, on_page=die_after_two)
        assert len(_roots(exporter.get_finished_spans())) == 2 * PAGE
        async with ledger.engine.connect() as conn:
            assert (await otel_follower.follower_state(conn, "otel"))[1] == 2 * PAGE

        # sessions end while no follower runs; then one follows live while more end
        await record_call_step(ledger, step=3, prefix="s3")
        await ledger.project()
        stop = asyncio.Event()
        following = asyncio.ensure_future(
            follow_otel(ledger, exporter, page_size=PAGE, poll_s=0.05, stop=stop)
        )
        await record_call_step(ledger, step=4, prefix="s4")
        await ledger.project()
        expected = await _terminal(ledger)
        assert len(expected) == 25
        await _wait_until(lambda: set(_roots(exporter.get_finished_spans())) == expected)
        stop.set()
        sent_by_second = await asyncio.wait_for(following, 60)
        assert sent_by_second == 25 - 2 * PAGE
        counts = Counter(_roots(exporter.get_finished_spans()))
        assert set(counts) == expected, "no gap"
        assert set(counts.values()) == {1}, "no repeat"
        async with ledger.engine.connect() as conn:
            assert (await otel_follower.follower_state(conn, "otel"))[1] == 25


class DiesAfterSending:
    """An exporter whose process dies right after its `n`-th request reached the receiver."""

    def __init__(self, inner: InMemorySpanExporter, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0

    def export(self, spans: Any) -> SpanExportResult:
        result = self.inner.export(spans)
        self.calls += 1
        if self.calls == self.n:
            raise Killed
        return result


async def test_a_kill_between_send_and_checkpoint_repeats_one_page_with_the_same_ids(
    db_url: str,
) -> None:
    async with Ledger.open(db_url, run=RUN) as ledger:
        for step in range(2):
            await record_call_step(ledger, step=step, prefix=f"s{step}")
        await ledger.project()
        received = InMemorySpanExporter()
        with pytest.raises(Killed):
            await follow_otel(ledger, DiesAfterSending(received, 2), page_size=PAGE)
        await follow_otel(ledger, received, page_size=PAGE, until_caught_up=True)
        spans = received.get_finished_spans()
        counts = Counter(_roots(spans))
        assert set(counts) == await _terminal(ledger), "no gap"
        repeated = {sid for sid, n in counts.items() if n > 1}
        assert len(repeated) == PAGE and set(counts.values()) == {1, 2}, "one page, sent twice"
        by_id: dict[tuple[int, int], set[str]] = {}
        for span in spans:
            by_id.setdefault((span.context.trace_id, span.context.span_id), set()).add(
                span.to_json()
            )
        assert all(len(versions) == 1 for versions in by_id.values()), "a repeat is identical"


async def test_followers_keep_their_own_checkpoints_and_refuse_a_stale_move(
    db_url: str,
) -> None:
    async with Ledger.open(db_url, run=RUN) as ledger:
        await record_call_step(ledger)
        await ledger.project()
        one, other = InMemorySpanExporter(), InMemorySpanExporter()
        assert await follow_otel(ledger, one, name="a", until_caught_up=True) == 5
        assert await follow_otel(ledger, one, name="a", until_caught_up=True) == 0
        assert await follow_otel(ledger, other, name="b", until_caught_up=True) == 5
        async with ledger.engine.begin() as conn:
            position, _ = await otel_follower.follower_state(conn, "a")
            with pytest.raises(otel_follower.FollowerConflict, match="another follower"):
                await otel_follower.move_follower(
                    conn, "a", previous=position - 1, position=position + 1, sent=1
                )


async def test_a_follower_of_one_run_leaves_other_runs_alone(db_url: str) -> None:
    async with Ledger.open(db_url, run="other") as ledger:
        await record_call_step(ledger, prefix="other")
    async with Ledger.open(db_url, run=RUN) as ledger:
        await record_call_step(ledger)
        await ledger.project()
        exporter = InMemorySpanExporter()
        await follow_otel(ledger, exporter, run=RUN, until_caught_up=True)
        roots = [s for s in exporter.get_finished_spans() if s.parent is None]
        assert {r.attributes[A.RUN] for r in roots} == {RUN}
        assert len(roots) == 5
        assert {r.resource.attributes["openinference.project.name"] for r in roots} == {RUN}
