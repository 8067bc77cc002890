"""Model calls (docs/design.md §15): any sequence of intents, records, failures and endings gives
a session whose rows are assembled from a complete set of calls, or a failure — never a short row;
the log replays and audits clean; partial work survives; bad calls are refused naming the call.

The generated sequences run through the real recorder on a SQLite file (one per test run, a run
per example); the by-hand tests run on both backends.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import InvalidInput, InvalidTransition
from sessions import events as ev
from sessions.audit.auditing import audit
from sessions.calls import assemble, full_prompts, shared_prefix
from tests.conftest import fresh_database

_runs = itertools.count()


@pytest.fixture(scope="module")
def sqlite_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fresh_database("sqlite", tmp_path_factory.mktemp("calls")) as url:
        yield url


def kw(**overrides: Any) -> dict[str, Any]:
    return {
        "uid": f"u{uuid.uuid4().hex[:12]}",
        "session_index": 0,
        "group_size": 1,
        "partition": "train",
        "global_step": 0,
        **overrides,
    }


# ------------------------------------------------------------------ a reference model
@dataclass
class _Conversation:
    """What the test expects, computed with plain lists: the calls recorded, in order."""

    recorded: list[tuple[str, list[int], list[int], list[float] | None, int | None]] = field(
        default_factory=list
    )
    open: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[list[int], list[int], list[int], list[float] | None]]:
        """(prompt, response, mask, logprobs) per row: a call whose prompt starts with the whole
        context so far continues the row, with what it adds at mask 0."""
        rows: list[list[Any]] = []
        context: list[int] | None = None
        for _cid, prompt, response, logprobs, _v in self.recorded:
            if context is not None and prompt[: len(context)] == context:
                row = rows[-1]
                added = prompt[len(context) :]
                row[1] += added + response
                row[2] += [0] * len(added) + [1] * len(response)
                row[3] = (
                    None
                    if row[3] is None or logprobs is None
                    else row[3] + [0.0] * len(added) + logprobs
                )
            else:
                rows.append(
                    [list(prompt), list(response), [1] * len(response), logprobs and list(logprobs)]
                )
            context = prompt + response
        return [tuple(r) for r in rows]  # type: ignore[misc]


tokens_ = st.lists(st.integers(0, 50), min_size=1, max_size=5)
#: The calls of a session, in order: each is started, then recorded (continuing the context with
#: some environment tokens, or starting over), failed, or left open; then the session ends.
calls_ = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "fail", "open"]),
        st.sampled_from(["continue", "continue", "fresh"]),
        st.lists(st.integers(0, 50), max_size=3),  # environment tokens between calls
        tokens_,
        st.booleans(),  # log-probs
        st.none() | st.integers(0, 5),  # version
    ),
    max_size=6,
)
endings = st.sampled_from(["complete", "crash", "fail"])


async def _drive(ledger: Any, sid: str, plan: list[tuple[Any, ...]], ending: str) -> _Conversation:
    expected = _Conversation()
    context: list[int] = []
    handle = await ledger.create_session(sid, **kw())
    for outcome, how, environment, response, with_logprobs, version in plan:
        cid = await handle.start_call()
        if outcome == "open":
            expected.open.append(cid)
        elif outcome == "fail":
            await handle.fail_call(cid, RuntimeError("the server hung up"))
        else:
            prompt = context + environment if how == "continue" and context else [51] + environment
            logprobs = [-0.5] * len(response) if with_logprobs else None
            await handle.record_call(
                cid,
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=logprobs,
                min_version=version,
            )
            expected.recorded.append((cid, prompt, response, logprobs, version))
            context = prompt + response
    if ending == "complete":
        await handle.post_reward(1.0)
        await handle.complete()
    elif ending == "fail":
        await handle.fail("sandbox_error", message="lost the sandbox")
    return expected


async def _run_plan(url: str, plan: list[tuple[Any, ...]], ending: str) -> dict[str, Any]:
    from sessions import Ledger

    run = f"calls{next(_runs)}"
    sid = f"{run}-s"
    async with Ledger.open(url, run=run) as ledger:
        expected = await _drive(ledger, sid, plan, ending)
        if ending == "crash":  # the process died: the recovery sweep fails what it left open
            from sessions.runs.recovery import recover

            await recover(ledger, timedelta(0))
        stream = [ev.decode(s).event for s in await ledger.store.read_stream(sid)]
        await ledger.project()
        report = await audit(ledger.engine)
    return {"expected": expected, "stream": stream, "audit": report}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=calls_, ending=endings)
def test_a_session_ends_with_rows_from_complete_calls_or_as_a_failure(
    sqlite_file: str, plan: list[tuple[Any, ...]], ending: str
) -> None:
    got = asyncio.run(_run_plan(sqlite_file, plan, ending))
    expected, stream = got["expected"], got["stream"]
    assert got["audit"].ok, got["audit"].divergences[:3]
    terminal = stream[-1] if not isinstance(stream[-1], ev.PlaceholderEmitted) else stream[-2]
    recorded_calls = [e for e in stream if isinstance(e, ev.ModelCallRecorded)]
    assert [e.call_id for e in recorded_calls] == [c[0] for c in expected.recorded], (
        "every answered call is in the log, whatever the ending"
    )
    rows = [e for e in stream if isinstance(e, ev.TrajectoryRecorded)]
    if ending == "complete" and expected.open:
        assert isinstance(terminal, ev.SessionFailed)
        assert terminal.reason == "incomplete_capture" and terminal.origin == "infra"
        assert all(cid in terminal.message for cid in expected.open)
        assert rows == [], "fail closed: no row from an incomplete capture"
    elif ending == "complete" and expected.recorded:
        assert isinstance(terminal, ev.SessionSucceeded)
        made = [
            (
                e.arrays().prompt_ids.tolist(),
                e.arrays().response_ids.tolist(),
                e.arrays().response_mask.tolist(),
                None if e.arrays().logprobs is None else e.arrays().logprobs.tolist(),
            )
            for e in rows
        ]
        assert made == expected.rows()
        assert [c for e in rows for c in e.from_calls] == [c[0] for c in expected.recorded]
        versions = [c[4] for c in expected.recorded if c[4] is not None]
        lows = [e.min_version for e in rows if e.min_version is not None]
        assert (min(lows) if lows else None) == (min(versions) if versions else None)
    else:
        assert isinstance(terminal, ev.SessionFailed) and rows == []
        assert (
            terminal.reason
            == {
                "complete": "empty_output",
                "crash": "orphaned",
                "fail": "sandbox_error",
            }[ending]
        )


# ------------------------------------------------------------------ by hand, both backends
@pytest.fixture
async def ledger(module_db_url: str) -> AsyncIterator[Any]:
    from sessions import Ledger

    async with Ledger.open(module_db_url) as opened:
        yield opened


@pytest.fixture
def ids() -> Callable[[str], str]:
    token = uuid.uuid4().hex[:8]
    return lambda name: f"{name}-{token}"


async def test_a_tool_conversation_is_one_row_as_verls_tool_agent_builds_it(
    module_db_url: str, ids: Any
) -> None:
    """Two model turns with a tool result between them: the prompt once, the responses at mask
    1 with their log-probs, the tool's tokens at mask 0 and log-prob 0; the versions span."""
    from sessions import Ledger

    async with Ledger.open(module_db_url, run=ids("tool")) as ledger:
        await _tool_conversation(ledger, ids)


async def _tool_conversation(ledger: Any, ids: Any) -> None:
    handle = await ledger.create_session(ids("tool"), **kw())
    first = await handle.start_call(sampling={"temperature": 1.0})
    await handle.record_call(
        first,
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        response_logprobs=[-0.1, -0.2],
        min_version=3,
    )
    second = await handle.start_call()
    await handle.record_call(
        second,
        prompt_ids=[1, 2, 3, 4, 5, 8, 9],
        response_ids=[6],
        response_logprobs=[-0.3],
        min_version=4,
        finish_reason="stop",
        latency_s=0.25,
    )
    await handle.post_reward(1.0)
    assert await handle.complete() == "succeeded"
    batch = await ledger.batch("train", 0, timeout=30, logprobs=True)
    attended = batch["attention_mask"][0].bool()
    assert batch["input_ids"][0][attended].tolist() == [1, 2, 3, 4, 5, 8, 9, 6]
    assert batch["response_mask"][0].tolist()[:5] == [1, 1, 0, 0, 1]
    assert batch["rollout_log_probs"][0].tolist()[:5] == pytest.approx([-0.1, -0.2, 0, 0, -0.3])
    versions = (batch["min_global_steps"], batch["max_global_steps"])
    assert [list(v) for v in versions] == [[3], [4]], "the versions verl stamps reach the batch"
    stream = [ev.decode(s).event for s in await ledger.store.read_stream(handle.session_id)]
    [row] = [e for e in stream if isinstance(e, ev.TrajectoryRecorded)]
    assert (row.min_version, row.max_version, row.from_calls) == (3, 4, [first, second])
    assert row.num_turns == 4  # one tool turn + two model turns + 1, verl's count
    [stored] = [e for e in stream if isinstance(e, ev.ModelCallRecorded) and e.call_id == second]
    assert (stored.prompt_shared, stored.prompt_len) == (5, 2), "only the new prompt tokens"
    from sqlalchemy import text

    async with ledger.engine.connect() as conn:  # the model_calls view (revision 0010)
        rows = (
            await conn.execute(
                text(
                    "SELECT call_id, outcome, prompt_tokens, response_tokens, min_version, "
                    "max_version, finish_reason, latency_s FROM model_calls "
                    "WHERE session_id = :sid ORDER BY started_position"
                ),
                {"sid": handle.session_id},
            )
        ).all()
        counts = (
            await conn.execute(
                text(
                    "SELECT model_calls, model_calls_failed FROM sessions WHERE session_id = :sid"
                ),
                {"sid": handle.session_id},
            )
        ).one()
    assert tuple(counts) == (2, 0)
    assert [tuple(r) for r in rows] == [
        (first, "recorded", 3, 2, 3, 3, None, None),
        (second, "recorded", 7, 1, 4, 4, "stop", 0.25),
    ]


async def test_a_handed_over_trajectory_is_the_row_and_the_calls_stay_in_the_log(
    ledger: Any, ids: Any
) -> None:
    handle = await ledger.create_session(ids("whole"), **kw())
    call = await handle.start_call()
    await handle.record_call(call, prompt_ids=[1], response_ids=[2])
    await handle.record_trajectory(
        prompt_ids=[7, 7], response_ids=[8, 8, 8], min_version=2, max_version=5
    )
    await handle.complete()
    stream = [ev.decode(s).event for s in await ledger.store.read_stream(handle.session_id)]
    [row] = [e for e in stream if isinstance(e, ev.TrajectoryRecorded)]
    assert row.from_calls == [] and (row.min_version, row.max_version) == (2, 5)
    assert row.arrays().prompt_ids.tolist() == [7, 7]


async def test_keep_partial_builds_the_row_from_the_calls_answered_before_the_first_open(
    module_db_url: str, ids: Any
) -> None:
    from sessions import Ledger, PlaceholderPolicy

    policy = PlaceholderPolicy(default="keep_partial")
    async with Ledger.open(module_db_url, placeholder_policy=policy, run=ids("partial")) as led:
        handle = await led.create_session(ids("p"), **kw())
        done = await handle.start_call()
        await handle.record_call(done, prompt_ids=[1, 2], response_ids=[3])
        await handle.start_call()  # never answered: the sandbox died meanwhile
        await handle.post_reward(0.5)
        await handle.fail("sandbox_error")
        stream = [ev.decode(s).event for s in await led.store.read_stream(handle.session_id)]
    [row] = [e for e in stream if isinstance(e, ev.TrajectoryRecorded)]
    failed = stream[-1]
    assert isinstance(failed, ev.SessionFailed) and failed.placeholder == "keep_partial"
    assert row.from_calls == [done] and failed.selected == [row.index] and failed.score == 0.5


async def test_a_retried_attempt_supersedes_its_calls(ledger: Any, ids: Any) -> None:
    handle = await ledger.create_session(ids("retry"), **kw())
    await handle.start_call("a")  # open when the attempt fails: superseded, not incomplete
    await handle.retry("sandbox_error")
    await handle.start()
    again = await handle.start_call("a")  # the id is free again in the new attempt
    await handle.record_call(again, prompt_ids=[1], response_ids=[2])
    assert await handle.complete() == "succeeded"


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        ("record_unknown", "no call 'nope' was started"),
        ("record_twice", "was recorded already"),
        ("fail_after_record", "was recorded already"),
        ("start_twice", "was started already"),
        ("versions_reversed", "above max_version"),
        ("negative_latency", "latency_s"),
        ("empty_id", "call_id"),
    ],
)
async def test_a_bad_call_command_is_refused_naming_the_call_and_writes_nothing(
    ledger: Any, ids: Any, command: str, fragment: str
) -> None:
    handle = await ledger.create_session(ids(command), **kw())
    call = await handle.start_call("x")
    await handle.record_call(call, prompt_ids=[1], response_ids=[2])
    before = handle.version
    attempts: dict[str, Callable[[], Any]] = {
        "record_unknown": lambda: handle.record_call("nope", prompt_ids=[1], response_ids=[2]),
        "record_twice": lambda: handle.record_call("x", prompt_ids=[1], response_ids=[2]),
        "fail_after_record": lambda: handle.fail_call("x", message="late"),
        "start_twice": lambda: handle.start_call("x"),
        "versions_reversed": lambda: handle.record_call(
            "x", prompt_ids=[1], response_ids=[2], min_version=5, max_version=4
        ),
        "negative_latency": lambda: handle.fail_call("x", latency_s=-1.0),
        "empty_id": lambda: handle.start_call(""),
    }
    with pytest.raises(InvalidInput, match=fragment):
        await attempts[command]()
    assert handle.version == before


async def test_a_call_outside_a_running_attempt_is_an_invalid_transition(
    ledger: Any, ids: Any
) -> None:
    handle = await ledger.create_session(ids("created"), start=False, **kw())
    with pytest.raises(InvalidTransition, match="start_call"):
        await handle.start_call()


# ------------------------------------------------------------------ the assembly alone
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), tokens_, tokens_), min_size=1, max_size=8))
def test_full_prompts_rebuild_every_prompt_from_the_deltas(
    calls: list[tuple[bool, list[int], list[int]]],
) -> None:
    context: np.ndarray | None = None
    made, prompts = [], []
    for i, (extend, added, response) in enumerate(calls):
        prompt = np.array(
            (context.tolist() if extend and context is not None else []) + added, dtype="<i4"
        )
        shared = shared_prefix(context, prompt)
        from sessions import tokens

        payload = tokens.encode(
            tokens.TokenArrays(
                prompt[shared:], np.array(response, "<i4"), np.ones(len(response), "u1"), None
            )
        )
        made.append(
            ev.ModelCallRecorded(
                call_id=f"c{i}",
                prompt_shared=shared,
                prompt_len=len(prompt) - shared,
                response_len=len(response),
                has_logprobs=False,
                payload=payload,
            )
        )
        prompts.append(prompt.tolist())
        context = np.concatenate((prompt, np.array(response, "<i4")))
    assert [p.tolist() for p, _c in full_prompts(made)] == prompts
    rows = assemble(made)
    assert sum(len(r.call_ids) for r in rows) == len(made)
    assert all(int(r.response_mask.sum()) > 0 for r in rows)


# ------------------------------------------------------------------ the audit re-assembles
@pytest.mark.parametrize("tamper", ["remove", "alter"])
async def test_audit_finds_a_removed_or_altered_call_behind_a_row(
    db_url: str, ids: Any, tamper: str
) -> None:
    from sqlalchemy import delete, update

    from sessions import Ledger
    from store.schema.tables import events

    async with Ledger.open(db_url, run=ids("tamper")) as ledger:
        handle = await ledger.create_session(ids("t"), **kw())
        first = await handle.start_call()
        await handle.record_call(first, prompt_ids=[1, 2], response_ids=[3, 4])
        second = await handle.start_call()
        await handle.record_call(second, prompt_ids=[1, 2, 3, 4, 5], response_ids=[6])
        await handle.complete()
        await ledger.project()
        assert (await audit(ledger.engine)).ok
        target = (events.c.session_id == handle.session_id) & (events.c.type == "ModelCallRecorded")
        async with ledger.engine.begin() as conn:
            rows = (await conn.execute(events.select().where(target))).all()
            row = rows[0]
            if tamper == "remove":
                await conn.execute(delete(events).where(events.c.position == row.position))
            else:  # the first response token changed: the call still decodes
                payload = bytearray(row.payload)
                payload[8] ^= 1  # prompt 1, 2 (8 bytes), then the response: 3 becomes 2
                await conn.execute(
                    update(events)
                    .where(events.c.position == row.position)
                    .values(payload=bytes(payload))
                )
        report = await audit(ledger.engine)
    assert any(d.field == "from_calls" for d in report.divergences), report.divergences[:3]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    prompts=st.lists(tokens_, min_size=2, max_size=5),
    order=st.randoms(use_true_random=False),
)
def test_concurrent_calls_recorded_out_of_start_order_keep_their_prompts(
    sqlite_file: str, prompts: list[list[int]], order: Any
) -> None:
    """A session's calls started together and answered in any order: each call's prompt, as
    rebuilt from the log (the handle's view and a fold of the stored events), is the one it sent
    (recording order is the order the stored deltas chain in)."""
    from sessions import Ledger
    from sessions import aggregate as agg

    async def run() -> None:
        async with Ledger.open(sqlite_file) as ledger:
            sid = f"conc-{uuid.uuid4().hex[:8]}"
            handle = await ledger.create_session(sid, **kw())
            started = [await handle.start_call() for _ in prompts]
            answers = list(zip(started, prompts))
            order.shuffle(answers)
            for call_id, prompt in answers:
                await handle.record_call(call_id, prompt_ids=[7, *prompt], response_ids=[1])
            sent = {call_id: [7, *prompt] for call_id, prompt in answers}
            for view in (
                handle.view,
                agg.fold(sid, [ev.decode(s).event for s in await ledger.store.read_stream(sid)]),
            ):
                rebuilt = full_prompts(view.recorded_calls())
                got = {
                    c.call_id: p.tolist() for c, (p, _ctx) in zip(view.recorded_calls(), rebuilt)
                }
                assert got == sent

    asyncio.run(run())
