"""The OpenTelemetry export, held against the SDK's in-memory span exporter on both backends.

One module-wide recording (the demo's agents and a step of sessions that record their model
calls, `recording.py`) is exported twice; the spans are compared with what the ledger's own
tables and views say: every terminal session is one trace, a failed session carries its reason,
origin and placeholder flag, the call spans' tokens add up to the session's and to the
`model_calls` view's, both exports send identical spans, and hostile text arrives escaped.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install -e '.[otel]'")

from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402
from sqlalchemy import text  # noqa: E402

from sessions import Ledger  # noqa: E402
from sessions.otel import attributes as A  # noqa: E402
from sessions.otel import ids  # noqa: E402
from sessions.otel.export import (  # noqa: E402
    OtelExportError,
    export_otel,
    otlp_exporter,
    parse_header,
)
from sessions.report.text import visible  # noqa: E402
from tests.conftest import BACKENDS, fresh_database  # noqa: E402
from tests.otel.recording import HOSTILE, MODEL, RUN, record_run  # noqa: E402


@dataclass
class Exported:
    """The module's recording, its two exports, and what the ledger's tables say."""

    first: list[Any] = field(default_factory=list)
    second: list[Any] = field(default_factory=list)
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: session_id -> (prompt tokens, response tokens) summed over the model_calls view
    view_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    summary_lines: list[str] = field(default_factory=list)


@pytest.fixture(scope="module", params=BACKENDS)
def exported(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Exported]:
    with fresh_database(request.param, tmp_path_factory.mktemp("otel")) as url:
        out = Exported()
        asyncio.run(_record_and_export(url, out))
        yield out


async def _record_and_export(url: str, out: Exported) -> None:
    async with Ledger.open(url, run=RUN) as ledger:
        await record_run(ledger)
        for spans in (out.first, out.second):
            exporter = InMemorySpanExporter()
            summary = await export_otel(ledger, exporter, page_size=7)
            spans.extend(exporter.get_finished_spans())
            out.summary_lines = summary.lines()
        async with ledger.engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT session_id, state, failure_reason, failure_origin, placeholder, "
                    "reward, attempts FROM sessions WHERE run = :run"
                ),
                {"run": RUN},
            )
            out.sessions = {row.session_id: dict(row._mapping) for row in rows}
            sums = await conn.execute(
                text(
                    "SELECT session_id, SUM(COALESCE(prompt_tokens, 0)), "
                    "SUM(COALESCE(response_tokens, 0)) FROM model_calls WHERE run = :run "
                    "GROUP BY session_id"
                ),
                {"run": RUN},
            )
            out.view_tokens = {sid: (int(p), int(r)) for sid, p, r in sums}


def _traces(spans: list[Any]) -> dict[int, list[Any]]:
    by_trace: dict[int, list[Any]] = defaultdict(list)
    for span in spans:
        by_trace[span.context.trace_id].append(span)
    return by_trace


def _root(spans: list[Any]) -> Any:
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1, [s.name for s in roots]
    return roots[0]


def test_every_terminal_session_is_one_trace_with_its_spans_linked(exported: Exported) -> None:
    terminal = {
        sid
        for sid, row in exported.sessions.items()
        if row["state"] in ("succeeded", "failed", "cancelled")
    }
    assert len(terminal) == len(exported.sessions) > 20
    traces = _traces(exported.first)
    assert set(traces) == {ids.trace_id(sid) for sid in terminal}
    for sid in terminal:
        spans = traces[ids.trace_id(sid)]
        root = _root(spans)
        assert root.attributes[A.CONVERSATION_ID] == visible(sid)
        assert root.attributes[A.RUN] == RUN
        assert root.attributes[A.OUTCOME] == exported.sessions[sid]["state"]
        known = {s.context.span_id for s in spans}
        assert len(known) == len(spans), "span ids are unique within a trace"
        for span in spans:
            assert span.start_time <= span.end_time
            if span.parent is not None:
                assert span.parent.span_id in known
                assert span.parent.trace_id == span.context.trace_id
        attempts = [s for s in spans if s.name.startswith("attempt ")]
        assert len(attempts) == (exported.sessions[sid]["attempts"] or 0)
    assert exported.summary_lines[0].startswith(f"exported {len(terminal)} sessions")


def test_a_failed_session_carries_its_reason_origin_and_placeholder(exported: Exported) -> None:
    traces = _traces(exported.first)
    failed = {sid: row for sid, row in exported.sessions.items() if row["state"] == "failed"}
    assert {row["failure_reason"] for row in failed.values()} >= {
        "runner_error",
        "sandbox_error",
        "timeout",
        "connection_error",
        "incomplete_capture",
    }
    for sid, row in failed.items():
        root = _root(traces[ids.trace_id(sid)])
        assert root.status.status_code is StatusCode.ERROR
        assert root.status.description.startswith(row["failure_reason"])
        assert root.attributes[A.FAILURE_REASON] == row["failure_reason"]
        assert root.attributes[A.FAILURE_ORIGIN] == row["failure_origin"]
        assert root.attributes[A.PLACEHOLDER] is bool(row["placeholder"])
        assert root.attributes.get(A.REWARD) == row["reward"]  # none: a failure has no reward
        placeholders = [e for e in root.events if e.name == A.EVENT_PLACEHOLDER]
        assert len(placeholders) == int(bool(row["placeholder"]))
        assert all(e.attributes["reward"] == 0.0 for e in placeholders)
        exceptions = [e for e in root.events if e.name == A.EVENT_EXCEPTION]
        assert len(exceptions) == 1
        assert exceptions[0].attributes[A.FAILURE_REASON] == row["failure_reason"]
    succeeded = [sid for sid, row in exported.sessions.items() if row["state"] == "succeeded"]
    for sid in succeeded:
        root = _root(traces[ids.trace_id(sid)])
        assert root.status.status_code is StatusCode.OK
        assert A.FAILURE_REASON not in root.attributes


def test_call_spans_add_up_to_the_session_and_to_the_model_calls_view(
    exported: Exported,
) -> None:
    traces = _traces(exported.first)
    with_calls = {sid for sid in exported.view_tokens}
    assert len(with_calls) == 5
    for sid, (prompt, response) in exported.view_tokens.items():
        spans = traces[ids.trace_id(sid)]
        calls = [s for s in spans if s.attributes.get(A.OPERATION) == "chat"]
        recorded = [s for s in calls if s.attributes[A.CALL_OUTCOME] == "recorded"]
        assert sum(s.attributes[A.INPUT_TOKENS] for s in recorded) == prompt
        assert sum(s.attributes[A.OUTPUT_TOKENS] for s in recorded) == response
        root = _root(spans)
        assert root.attributes[A.INPUT_TOKENS] == prompt
        assert root.attributes[A.OUTPUT_TOKENS] == response
        assert root.attributes[A.MODEL] == MODEL
        for call in calls:  # each call hangs off its attempt's span
            parent = next(s for s in spans if s.context.span_id == call.parent.span_id)
            assert parent.name == f"attempt {call.attributes[A.ATTEMPT]}"
    spans = traces[ids.trace_id("calls-call-failed")]
    failed_call = next(s for s in spans if s.attributes.get(A.CALL_OUTCOME) == "failed")
    assert failed_call.status.status_code is StatusCode.ERROR
    assert failed_call.attributes[A.ERROR_TYPE] == "ReadError"
    open_call = next(
        s
        for s in traces[ids.trace_id("calls-incomplete")]
        if s.attributes.get(A.CALL_OUTCOME) == "open"
    )
    assert open_call.status.description.startswith("incomplete_capture")
    retried = traces[ids.trace_id("calls-retried")]
    first_attempt = next(s for s in retried if s.name == "attempt 1")
    assert first_attempt.status.status_code is StatusCode.ERROR
    assert [e.name for e in first_attempt.events] == [A.EVENT_ATTEMPT_FAILED]


def test_exporting_twice_sends_identical_spans(exported: Exported) -> None:
    def keyed(spans: list[Any]) -> dict[tuple[int, int], str]:
        return {(s.context.trace_id, s.context.span_id): s.to_json() for s in spans}

    first, second = keyed(exported.first), keyed(exported.second)
    assert len(first) == len(exported.first), "no two spans share an id"
    assert first == second


def test_hostile_text_arrives_escaped_as_data(exported: Exported) -> None:
    def texts(span: Any) -> Iterator[str]:
        for value in span.attributes.values():
            yield from (value if isinstance(value, tuple) else (value,))
        for event in span.events:
            yield from (v for v in event.attributes.values() if isinstance(v, str))
        if span.status.description:
            yield span.status.description
        yield span.name

    for span in exported.first:
        for value in texts(span):
            if isinstance(value, str):
                assert all(ch.isprintable() for ch in value), (span.name, value)
    root = _root(_traces(exported.first)[ids.trace_id("calls-sandbox")])
    assert root.attributes[A.DATA_SOURCE] == visible(HOSTILE)
    assert "<script>alert('x')</script>" in root.attributes[A.FAILURE_MESSAGE]
    assert "\\x1b[31m" in root.attributes[A.FAILURE_MESSAGE]
    call = next(
        s
        for s in _traces(exported.first)[ids.trace_id("calls-sandbox")]
        if s.attributes.get(A.OPERATION) == "chat"
    )
    assert call.attributes[A.CALL_TEXT] == visible(HOSTILE)


async def test_a_step_range_exports_only_its_sessions_and_leaves_open_ones_out(
    db_url: str,
) -> None:
    async with Ledger.open(db_url, run=RUN) as ledger:
        from tests.otel.recording import record_call_step

        await record_call_step(ledger, step=5, prefix="five")
        await record_call_step(ledger, step=6, prefix="six")
        still_open = await ledger.create_session(
            "six-open",
            uid="six-open",
            session_index=0,
            group_size=1,
            partition="train",
            global_step=6,
        )
        await ledger.project()
        exporter = InMemorySpanExporter()
        summary = await export_otel(ledger, exporter, steps="6:6")
        roots = [s for s in exporter.get_finished_spans() if s.parent is None]
        assert sorted(r.attributes[A.SESSION_ID] for r in roots) == sorted(
            f"six-{name}" for name in ("ok", "call-failed", "incomplete", "retried", "sandbox")
        )
        assert {r.attributes[A.STEP] for r in roots} == {6}
        assert summary.open == 1
        assert "left out 1 sessions still open" in summary.lines()[1]
        await still_open.cancel("done")


class _Refusing:
    """A span exporter whose receiver refuses everything."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.FAILURE


async def test_a_refused_export_is_an_error_that_says_what_to_check(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url, run=RUN) as ledger:
        from tests.otel.recording import record_call_step

        await record_call_step(ledger)
        await ledger.project()
        with pytest.raises(OtelExportError, match="--endpoint"):
            await export_otel(ledger, _Refusing())


async def test_an_unreachable_receiver_is_an_error(sqlite_url: str) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with Ledger.open(sqlite_url, run=RUN) as ledger:
        from tests.otel.recording import record_call_step

        await record_call_step(ledger)
        await ledger.project()
        exporter = otlp_exporter(f"http://127.0.0.1:{port}", timeout_s=2.0)
        try:
            with pytest.raises(OtelExportError, match="did not take"):
                await export_otel(ledger, exporter)
        finally:
            exporter.shutdown()


def test_endpoint_and_header_forms() -> None:
    from sessions.errors import ConfigError
    from sessions.otel.export import traces_url

    assert traces_url("http://127.0.0.1:6006") == "http://127.0.0.1:6006/v1/traces"
    assert (
        traces_url("https://h/api/public/otel/v1/traces") == "https://h/api/public/otel/v1/traces"
    )
    assert parse_header("authorization=Bearer a=b") == ("authorization", "Bearer a=b")
    for bad in ("novalue", "=x"):
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_header(bad)
    with pytest.raises(ConfigError, match="http"):
        traces_url("127.0.0.1:6006")


_ids = st.text(min_size=1, max_size=40)


@given(a=st.tuples(_ids, st.integers(1, 50), _ids), b=st.tuples(_ids, st.integers(1, 50), _ids))
def test_derived_ids_are_valid_and_differ_for_different_keys(
    a: tuple[str, int, str], b: tuple[str, int, str]
) -> None:
    for session_id, attempt, call_id in (a, b):
        assert 0 < ids.trace_id(session_id) < 2**128
        for span_id in (
            ids.session_span_id(session_id),
            ids.attempt_span_id(session_id, attempt),
            ids.call_span_id(session_id, attempt, call_id),
        ):
            assert 0 < span_id < 2**64
    if a != b:
        assert ids.call_span_id(*a) != ids.call_span_id(*b)
    if a[0] != b[0]:
        assert ids.trace_id(a[0]) != ids.trace_id(b[0])
    # a key's parts never run together: ("ab", "c") and ("a", "bc") are different calls
    assert ids.call_span_id(a[0] + "1", 1, a[2]) != ids.call_span_id(a[0], 11, a[2])


async def test_hostile_run_session_and_group_ids_reach_the_spans_escaped(sqlite_url: str) -> None:
    run, session_id, uid = "r\x1b[2Jx", "s<b>\x1b[31m\u202e", "u\x07<i>"
    async with Ledger.open(sqlite_url, run=run) as ledger:
        async with ledger.session(
            session_id, uid=uid, session_index=0, group_size=1, partition="train", global_step=0
        ) as s:
            call = await s.start_call(sampling={"model": "m\x1b[0m"})
            await s.record_call(call, prompt_ids=[1], response_ids=[2], text="\x00\x1b]8;;x\x07")
        await ledger.project()
        exporter = InMemorySpanExporter()
        await export_otel(ledger, exporter)
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {ids.trace_id(session_id)}
    root = _root(spans)
    assert root.attributes[A.CONVERSATION_ID] == visible(session_id) == "s<b>\\x1b[31m\\u202e"
    assert root.attributes[A.RUN] == visible(run)
    assert root.attributes[A.GROUP] == visible(uid)
    assert root.name == f"session {visible(session_id)}"
    for span in spans:
        values = [span.name, *span.resource.attributes.values(), *span.attributes.values()]
        for value in values:
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, str):
                    assert item.isprintable(), (span.name, item)
    assert root.resource.attributes["openinference.project.name"] == visible(run)
