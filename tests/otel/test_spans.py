"""Any session's spans are a well-formed trace: generated sessions (attempts, model calls that are
recorded, fail or stay open, each ending) recorded through a real ledger, then turned into spans.

Whatever the script, the trace has one root, every parent is in it, no child ends after the
root, one span per attempt and per started call, the call spans' tokens add up to the root's,
the status says how the session ended, and building the spans twice gives the same spans.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install -e '.[otel]'")

from opentelemetry.trace import StatusCode  # noqa: E402

from sessions import Ledger  # noqa: E402
from sessions import events as ev  # noqa: E402
from sessions.otel import attributes as A  # noqa: E402
from sessions.otel.spans import build_spans  # noqa: E402
from tests.conftest import fresh_database  # noqa: E402

CALL = st.sampled_from(["recorded", "failed"])
#: Each attempt: its calls; a retried attempt's calls are all settled (recorded or failed).
ATTEMPT = st.lists(CALL, max_size=4)
SCRIPT = st.tuples(
    st.lists(ATTEMPT, min_size=1, max_size=3),
    st.booleans(),  # the last attempt leaves one call open (complete then fails closed)
    st.sampled_from(["complete", "fail", "cancel"]),
    st.lists(st.integers(1, 40), min_size=2, max_size=2),  # prompt and response lengths
)
_numbers = itertools.count()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fresh_database("sqlite", tmp_path_factory.mktemp("spans")) as made:
        yield made


async def _record(url: str, session_id: str, script: Any) -> tuple[list[ev.Recorded], int]:
    """Record the script's session; its decoded events and the response tokens it recorded."""
    attempts, leave_open, ending, (prompt_len, response_len) = script
    recorded_out = 0
    async with Ledger.open(url, run="spans") as ledger:
        handle = await ledger.create_session(
            session_id, uid=session_id, session_index=0, group_size=1, partition="train"
        )
        for number, calls in enumerate(attempts, start=1):
            if number > 1:
                await handle.start()
            for outcome in calls:
                call = await handle.start_call(sampling={"model": "m"})
                if outcome == "recorded":
                    await handle.record_call(
                        call, prompt_ids=[1] * prompt_len, response_ids=[2] * response_len
                    )
                    recorded_out += response_len
                else:
                    await handle.fail_call(call, message="refused", error_type="HTTPError")
            if number < len(attempts):
                await handle.retry("timeout", message=f"attempt {number} hung")
        if leave_open:
            await handle.start_call()
        if ending == "complete":
            if not leave_open and not any(c == "recorded" for c in attempts[-1]):
                await handle.record_trajectory(prompt_ids=[1], response_ids=[2], response_mask=[1])
            await handle.complete()
        elif ending == "fail":
            await handle.fail("runner_error", message="the runner gave up")
        else:
            await handle.cancel("stopped")
        stream = await ledger.store.read_streams([session_id], with_payload=False)
    return [ev.decode(stored) for stored in stream[session_id]], recorded_out


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=SCRIPT)
def test_any_sessions_spans_are_a_well_formed_trace(url: str, script: Any) -> None:
    session_id = f"gen-{next(_numbers)}"
    recorded, response_tokens = asyncio.run(_record(url, session_id, script))
    spans = build_spans(session_id, recorded)
    assert [s.to_json() for s in spans] == [s.to_json() for s in build_spans(session_id, recorded)]

    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1 and spans[0] is roots[0]
    root = roots[0]
    by_id = {s.context.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    for span in spans:
        assert span.start_time <= span.end_time <= root.end_time
        if span.parent is not None:
            assert span.parent.span_id in by_id

    attempts, leave_open, ending, _ = script
    started = sum(isinstance(r.event, ev.ModelCallStarted) for r in recorded)
    assert started == sum(len(calls) for calls in attempts) + int(leave_open)
    calls = [s for s in spans if s.attributes.get(A.OPERATION) == "chat"]
    assert len(calls) == started
    assert len([s for s in spans if s.name.startswith("attempt ")]) == len(attempts)
    assert sum(c.attributes.get(A.OUTPUT_TOKENS, 0) for c in calls) == response_tokens
    if started:
        assert root.attributes[A.OUTPUT_TOKENS] == response_tokens

    outcome = root.attributes[A.OUTCOME]
    if ending == "cancel":
        assert outcome == "cancelled" and root.status.status_code is StatusCode.UNSET
    elif ending == "fail" or leave_open:
        assert outcome == "failed" and root.status.status_code is StatusCode.ERROR
        expected = "runner_error" if ending == "fail" else "incomplete_capture"
        assert root.attributes[A.FAILURE_REASON] == expected
    else:
        assert outcome == "succeeded" and root.status.status_code is StatusCode.OK
    open_calls = [c for c in calls if c.attributes[A.CALL_OUTCOME] == "open"]
    assert len(open_calls) == int(leave_open)
    assert all(c.status.status_code is StatusCode.ERROR for c in open_calls)
