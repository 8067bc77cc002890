"""`SyncLedger`: the ledger from synchronous code, worker threads and other event loops (issue #14
item 10), on both backends.

No test here runs an event loop in its own thread unless it says so: the synchronous training
loop is the case verl's `RayPPOTrainer.fit` is. Every blocking call is bounded (`call_timeout`,
thread joins with timeouts, a subprocess timeout), so a bug fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import (
    InvalidInput,
    InvalidTransition,
    LedgerError,
    SandboxError,
    SchemaError,
    SessionProxy,
    SyncLedger,
    SyncSession,
)
from tests import REPO
from tests.conftest import default_sigint

pytestmark = pytest.mark.verl_env

REPO = REPO
#: Seconds any blocking call of these tests may take before it fails the test.
CALL_TIMEOUT = 60.0
JOIN = 60.0


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rollout-ledger-loop"]


def settled_threads(
    baseline: set[threading.Thread], seconds: float = 10.0
) -> set[threading.Thread]:
    """Threads beyond `baseline` still alive after up to `seconds` (drivers' own threads end on dispose)."""
    deadline = time.monotonic() + seconds
    while True:
        extra = {t for t in threading.enumerate() if t not in baseline and t.is_alive()}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


def identity(
    uid: str, index: int, size: int, step: int | None = 0, partition: str = "train", **more: Any
) -> dict[str, Any]:
    return {
        "uid": uid,
        "session_index": index,
        "group_size": size,
        "partition": partition,
        "global_step": step,
        **more,
    }


def trajectory(index: int = 0) -> dict[str, Any]:
    return {"prompt_ids": [1, 2, 3], "response_ids": [4, 5 + index % 7]}


def scalar_metrics(
    ledger: SyncLedger, partition: str, step: int | None, run: str | None = None
) -> dict[str, float]:
    return {
        m.metric: m.value for m in ledger.metrics(partition, step, run=run) if m.data_source is None
    }


def run_in_threads(targets: list[Callable[[], None]], timeout: float = JOIN) -> None:
    """Start every target at once (a barrier), join them within `timeout`, re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                barrier.wait(timeout)
                target()
            except BaseException as error:  # noqa: BLE001 - handed to the test below
                errors.append(error)

        return body

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not [t for t in threads if t.is_alive()], f"threads still running after {timeout}s"
    if errors:
        raise errors[0]


@pytest.fixture
def ledger(db_url: str) -> Iterator[SyncLedger]:
    with SyncLedger.open(db_url, call_timeout=CALL_TIMEOUT) as opened:
        yield opened


# ------------------------------------------------------------ outcomes, one session each
class Cancelled(BaseException):
    """Stands for Ctrl-C inside a `with ledger.session(...)` block (KeyboardInterrupt itself would stop pytest
    if it ever escaped); the block treats every BaseException that is not an Exception as cancellation."""


OUTCOMES = ("ok", "ok_half", "error", "timeout", "sandbox", "cancel")
REWARD = {"ok": 1.0, "ok_half": 0.5}


def record_blocking(
    ledger: SyncLedger, session_id: str, outcome: str, run: str | None = None, **ident: Any
) -> str:
    """Record one session through the blocking context manager; the state it ended in."""
    handle: SyncSession | None = None
    try:
        with ledger.session(session_id, run=run, **ident) as handle:
            handle.record_trajectory(**trajectory(ident.get("session_index", 0)))
            if outcome == "error":
                raise RuntimeError("policy crashed")
            if outcome == "timeout":
                raise TimeoutError("tool call took too long")
            if outcome == "sandbox":
                raise SandboxError("container died")
            if outcome == "cancel":
                raise Cancelled()
            handle.post_reward(REWARD[outcome])
    except (RuntimeError, TimeoutError, SandboxError, Cancelled) as raised:
        assert outcome in ("error", "timeout", "sandbox", "cancel"), f"{outcome} raised {raised!r}"
    assert handle is not None
    return handle.state


def expected_counts(outcomes: list[str]) -> dict[str, float]:
    count = Counter(outcomes)
    failed = count["error"] + count["timeout"] + count["sandbox"]
    expected = {
        "sessions/total": len(outcomes),
        "sessions/succeeded": count["ok"] + count["ok_half"],
        "sessions/failed": failed,
        "sessions/cancelled": count["cancel"],
        "placeholders": failed,
        "rows/total": count["ok"] + count["ok_half"] + failed,
        "reward/sum": count["ok"] * 1.0 + count["ok_half"] * 0.5,
    }
    for reason, name in (
        ("runner_error", "error"),
        ("timeout", "timeout"),
        ("sandbox_error", "sandbox"),
    ):
        if count[name]:
            expected[f"failed/{reason}"] = count[name]
    return expected


# ------------------------------------------------------------------ a synchronous loop
STEP_PLAN = [  # per group (uid) of 4: what each session does
    ["ok", "ok_half", "ok", "ok"],
    ["ok", "error", "timeout", "ok_half"],
    ["ok_half", "cancel", "ok", "error"],
]


def test_a_plain_synchronous_training_loop_records_and_reads_two_steps(ledger: SyncLedger) -> None:
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()  # nothing async in this thread: the trainer is plain code
    for step in (0, 1):
        states: dict[str, str] = {}
        for g, plan in enumerate(STEP_PLAN):
            uid = f"s{step}g{g}"
            for index, outcome in enumerate(plan):
                sid = f"{uid}-{index}"
                states[sid] = record_blocking(ledger, sid, outcome, **identity(uid, index, 4, step))
        expected_state = {
            "ok": "succeeded",
            "ok_half": "succeeded",
            "error": "failed",
            "timeout": "failed",
            "sandbox": "failed",
            "cancel": "cancelled",
        }
        assert states == {
            f"s{step}g{g}-{i}": expected_state[o]
            for g, p in enumerate(STEP_PLAN)
            for i, o in enumerate(p)
        }
        assert ledger.load_session(f"s{step}g1-2").view.failure_reason == "timeout"
        assert ledger.load_session(f"s{step}g1-1").view.failure_reason == "runner_error"

        batch = ledger.batch("train", step, timeout=30)
        from sessions.batches import non_tensor

        flat = [o for plan in STEP_PLAN for o in plan]
        assert batch.batch_size[0] == len([o for o in flat if o != "cancel"])
        rewards = dict(zip(non_tensor(batch, "session_id"), batch["rm_scores"].sum(-1).tolist()))
        assert rewards == {
            f"s{step}g{g}-{i}": REWARD.get(o, 0.0)
            for g, p in enumerate(STEP_PLAN)
            for i, o in enumerate(p)
            if o != "cancel"
        }
        assert int(batch["is_placeholder"].sum()) == flat.count("error") + flat.count("timeout")
        metrics = scalar_metrics(ledger, "train", step)
        for name, value in expected_counts(flat).items():
            assert metrics[name] == pytest.approx(value), name
        assert metrics["reward/mean"] == pytest.approx(
            sum(REWARD.get(o, 0.0) for o in flat) / batch.batch_size[0]
        )
    assert ledger.project() == 0  # everything projected already


def test_run_session_blocking_takes_an_async_runner_that_runs_in_the_calling_thread(
    ledger: SyncLedger,
) -> None:
    seen: dict[str, Any] = {}

    async def runner(session: SessionProxy) -> None:
        seen["thread"] = threading.get_ident()
        await session.record_trajectory(**trajectory())
        await session.post_reward(0.25)

    async def slow(session: SessionProxy) -> None:
        await session.record_trajectory(**trajectory())
        await asyncio.sleep(30)

    async def broken(session: SessionProxy) -> None:
        raise ValueError("bad tool output")

    ok = ledger.run_session(runner, "r-ok", **identity("r1", 0, 1, 5))
    late = ledger.run_session(slow, "r-late", timeout=0.3, **identity("r2", 0, 1, 5))
    bad = ledger.run_session(broken, "r-bad", **identity("r3", 0, 1, 5))
    sync_fn = ledger.run_session(lambda s: None, "r-sync", **identity("r4", 0, 1, 5))  # type: ignore[arg-type, return-value]
    assert seen["thread"] == threading.get_ident()
    assert (ok.state, ok.failure_reason) == ("succeeded", None)
    assert (late.state, late.failure_reason, type(late.error)) == (
        "failed",
        "timeout",
        TimeoutError,
    )
    assert (bad.state, bad.failure_reason, type(bad.error), str(bad.error)) == (
        "failed",
        "runner_error",
        ValueError,
        "bad tool output",
    )
    assert (
        sync_fn.state == "failed"
        and isinstance(sync_fn.error, TypeError)
        and "async runner" in str(sync_fn.error)
    )
    assert scalar_metrics(ledger, "train", 5)["reward/sum"] == pytest.approx(0.25)


# --------------------------------------------------------------------- worker threads
def test_eight_worker_threads_record_into_shared_groups_concurrently(ledger: SyncLedger) -> None:
    """Each thread records one session of every group (its index), so every group's appends race."""
    threads, groups = 8, 5

    def worker(index: int) -> Callable[[], None]:
        def work() -> None:
            for g in range(groups):
                outcome = ("ok", "error", "cancel", "ok_half")[(index + g) % 4]
                record_blocking(
                    ledger, f"w{g}-{index}", outcome, **identity(f"wg{g}", index, threads, 3)
                )

        return work

    run_in_threads([worker(i) for i in range(threads)])
    flat = [
        ("ok", "error", "cancel", "ok_half")[(i + g) % 4]
        for i in range(threads)
        for g in range(groups)
    ]
    metrics = scalar_metrics(ledger, "train", 3)
    for name, value in expected_counts(flat).items():
        assert metrics[name] == pytest.approx(value), name
    assert metrics["groups/total"] == groups and metrics["groups/unsettled"] == 0
    assert ledger.batch("train", 3, timeout=30).batch_size[0] == len(flat) - flat.count("cancel")


@pytest.fixture(scope="module")
def shared_ledger(module_db_url: str) -> Iterator[SyncLedger]:
    with SyncLedger.open(module_db_url, call_timeout=CALL_TIMEOUT) as opened:
        yield opened


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(
        st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=4), min_size=2, max_size=6
    )
)
def test_generated_interleavings_per_thread_count_exactly_what_happened(
    shared_ledger: SyncLedger, plan: list[list[str]]
) -> None:
    """Threads (one outcome list each) record at once; the metrics equal the outcomes, whatever the interleaving."""
    run = f"h{uuid.uuid4().hex[:10]}"

    def worker(t: int, outcomes: list[str]) -> Callable[[], None]:
        def work() -> None:
            for i, outcome in enumerate(outcomes):
                record_blocking(
                    shared_ledger,
                    f"{run}-{t}-{i}",
                    outcome,
                    run=run,
                    **identity(f"{run}u{t}x{i}", 0, 1, 0),
                )

        return work

    run_in_threads([worker(t, outcomes) for t, outcomes in enumerate(plan)])
    metrics = scalar_metrics(shared_ledger, "train", 0, run=run)
    for name, value in expected_counts([o for outcomes in plan for o in outcomes]).items():
        assert metrics.get(name, 0.0) == pytest.approx(value), name


# -------------------------------------------------------------------- other event loops
def test_async_runners_on_other_loops_in_other_threads_record_through_it(
    ledger: SyncLedger,
) -> None:
    loops, per_loop = 4, 3
    where: dict[str, int] = {}

    def on_its_own_loop(t: int) -> Callable[[], None]:
        async def ok(session: SessionProxy) -> None:
            where[session.session_id] = threading.get_ident()
            await session.record_trajectory(**trajectory())
            await asyncio.sleep(0.01)  # the caller's loop keeps running between commands
            await session.post_reward(1.0)

        async def crash(session: SessionProxy) -> None:
            await session.record_trajectory(**trajectory())
            raise KeyError("missing tool")

        async def hang(session: SessionProxy) -> None:
            await asyncio.sleep(30)

        async def main() -> None:
            outcomes = await asyncio.gather(
                *(
                    # only the hanging runner may time out: 0.5 s for it, a loaded host's worth for the others
                    ledger.arun_session(
                        runner,
                        f"a{t}-{name}-{i}",
                        timeout=0.5 if name == "hang" else 30.0,
                        **identity(f"a{t}{name}{i}", 0, 1, 7),
                    )
                    for i in range(per_loop)
                    for name, runner in (("ok", ok), ("crash", crash), ("hang", hang))
                )
            )
            assert Counter((o.state, o.failure_reason) for o in outcomes) == {
                ("succeeded", None): per_loop,
                ("failed", "runner_error"): per_loop,
                ("failed", "timeout"): per_loop,
            }
            async with ledger.asession(f"a{t}-ctx", **identity(f"a{t}ctx", 0, 1, 7)) as session:
                await session.record_trajectory(**trajectory())
                await session.post_reward(0.5)
            assert session.state == "succeeded"
            with pytest.raises(ZeroDivisionError):
                async with ledger.asession(
                    f"a{t}-ctxfail", **identity(f"a{t}ctxfail", 0, 1, 7)
                ) as failing:
                    raise ZeroDivisionError("division by zero")
            assert (failing.state, failing.view.failure_reason) == ("failed", "runner_error")
            stuck = asyncio.ensure_future(stuck_session(f"a{t}-stuck"))
            await asyncio.sleep(0.2)
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck

        async def stuck_session(sid: str) -> None:
            async with ledger.asession(sid, **identity(sid, 0, 1, 7)) as session:
                await session.record_trajectory(**trajectory())
                await asyncio.sleep(30)

        return lambda: asyncio.run(asyncio.wait_for(main(), CALL_TIMEOUT))

    run_in_threads([on_its_own_loop(t) for t in range(loops)])
    assert ledger.load_session("a0-stuck").state == "cancelled"
    assert len(set(where.values())) == loops and threading.get_ident() not in where.values()
    assert not {t.ident for t in loop_threads()} & set(
        where.values()
    )  # runners never ran on the ledger's loop
    metrics = scalar_metrics(ledger, "train", 7)
    assert metrics["sessions/succeeded"] == loops * (per_loop + 1)
    assert metrics["sessions/failed"] == loops * (2 * per_loop + 1)
    assert metrics["sessions/cancelled"] == loops
    assert metrics["failed/timeout"] == loops * per_loop


def test_the_ledger_outlives_separate_asyncio_run_calls_in_the_main_thread(
    ledger: SyncLedger,
) -> None:
    async def first() -> str:
        async with ledger.asession("loop1", **identity("l1", 0, 2, 9)) as session:
            await session.record_trajectory(**trajectory())
            await session.post_reward(1.0)
        return session.state

    async def second() -> Any:
        async def runner(session: SessionProxy) -> None:
            await session.record_trajectory(**trajectory())
            await session.post_reward(0.0)

        outcome = await ledger.arun_session(runner, "loop2", **identity("l1", 1, 2, 9))
        return outcome, await ledger.abatch("train", 9, timeout=30)

    async def third() -> dict[str, float]:
        assert await ledger.aproject() == 0
        return {
            m.metric: m.value for m in await ledger.ametrics("train", 9) if m.data_source is None
        }

    assert asyncio.run(first()) == "succeeded"
    outcome, batch = asyncio.run(second())
    assert outcome.succeeded and batch.batch_size[0] == 2
    assert scalar_metrics(ledger, "train", 9)["reward/mean@2"] == pytest.approx(
        0.5
    )  # blocking, between the runs
    assert asyncio.run(third())["reward/mean@2"] == pytest.approx(0.5)


# ------------------------------------------------------------------------------ errors
def test_errors_from_the_ledgers_loop_keep_their_type_message_and_attributes(
    ledger: SyncLedger,
) -> None:
    session = ledger.create_session("e1", **identity("e1", 0, 1, 11))
    with pytest.raises(InvalidInput, match="response_mask") as bad:
        session.record_trajectory(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 7])
    assert (bad.value.session_id, bad.value.field) == ("e1", "response_mask")
    assert (
        session.complete() == "failed"
    )  # no trajectory: failed / empty_output, as SessionHandle.complete
    with pytest.raises(InvalidTransition) as late:
        session.post_reward(1.0)
    assert (late.value.state, late.value.session_id) == ("failed", "e1")
    with pytest.raises(InvalidInput, match="already exists"):
        ledger.create_session("e1", **identity("e1b", 0, 1, 11))
    with pytest.raises(InvalidInput, match="'nope' is not a partition"):
        ledger.batch("nope", 0)
    with pytest.raises(InvalidInput, match="no such session"):
        ledger.load_session("nobody")
    ledger.create_session("e-open", **identity("e-open", 0, 1, 12))
    with pytest.raises(TimeoutError, match="unsettled"):
        ledger.batch("train", 12, timeout=0.3)

    async def from_another_loop() -> None:
        with pytest.raises(InvalidTransition):
            async with ledger.asession("e2", **identity("e2", 0, 1, 11)) as proxy:
                await proxy.complete()
                await proxy.post_reward(1.0)
        with pytest.raises(InvalidInput, match="group_size"):
            await ledger.arun_session(_noop, "e3", **identity("e3", 0, 0, 11))
        with pytest.raises(TimeoutError, match="unsettled"):
            await ledger.abatch("train", 12, timeout=0.3)

    asyncio.run(asyncio.wait_for(from_another_loop(), CALL_TIMEOUT))


async def _noop(session: SessionProxy) -> None:
    return None


def test_blocking_calls_on_the_ledgers_own_loop_thread_are_refused_not_deadlocked(
    ledger: SyncLedger,
) -> None:
    import concurrent.futures

    answer: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

    def on_the_loop() -> None:
        refused = []
        for call in (
            ledger.project,
            ledger.metrics,
            lambda: ledger.batch("train", 0),
            ledger.close,
            lambda: ledger.create_session("x", **identity("x", 0, 1)),
        ):
            try:
                call()
            except LedgerError as error:
                refused.append(str(error))
        answer.set_result(refused)

    ledger.loop.call_soon_threadsafe(on_the_loop)
    refused = answer.result(timeout=10)
    assert len(refused) == 5 and all(
        "own" in message and "thread" in message for message in refused
    ), refused
    assert not ledger.closed and ledger.project() == 0  # and the ledger still serves


def test_open_errors_raise_in_the_caller_and_leave_no_thread(db_url: str) -> None:
    baseline = set(threading.enumerate())
    with pytest.raises(SchemaError):
        SyncLedger.open(db_url, migrate=False)  # an empty database has no schema
    assert not settled_threads(baseline)


# ----------------------------------------------------------------------------- closing
def test_close_is_idempotent_joins_its_thread_and_any_later_call_fails_fast(db_url: str) -> None:
    baseline = set(threading.enumerate())
    for _ in range(3):  # open / close cycles leave nothing behind
        with SyncLedger.open(db_url, call_timeout=CALL_TIMEOUT) as ledger:
            assert len(set(loop_threads()) - baseline) == 1
            kept = ledger.create_session(
                f"c{uuid.uuid4().hex[:6]}", **identity(uuid.uuid4().hex[:6], 0, 1, 0)
            )
            kept.record_trajectory(**trajectory())
        ledger.close()
        ledger.close()
        assert ledger.closed
        assert not settled_threads(baseline)

    async def a_proxy_call() -> None:
        async with ledger.asession("late", **identity("late", 0, 1, 0)):
            pass

    calls: list[Callable[[], Any]] = [
        ledger.project,
        ledger.metrics,
        lambda: ledger.batch("train", 0),
        lambda: kept.complete(),
        lambda: ledger.create_session("late", **identity("late", 0, 1, 0)),
        lambda: ledger.load_session("x"),
        lambda: ledger.session("late", **identity("late", 0, 1, 0)).__enter__(),
        lambda: ledger.run_session(_noop, "late", **identity("late", 0, 1, 0)),
        lambda: asyncio.run(a_proxy_call()),
        lambda: asyncio.run(ledger.ametrics()),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(LedgerError, match="closed"):
            call()
        assert time.monotonic() - started < 1.0


def test_close_cancels_calls_under_way_and_records_their_cancellation(db_url: str) -> None:
    ledger = SyncLedger.open(db_url, call_timeout=CALL_TIMEOUT)
    started = threading.Event()
    raised: list[BaseException] = []

    async def stuck(session: SessionProxy) -> None:
        await session.record_trajectory(**trajectory())
        started.set()
        await asyncio.sleep(30)

    def call() -> None:
        try:
            ledger.run_session(stuck, "closing", **identity("closing", 0, 1, 0))
        except BaseException as error:  # noqa: BLE001
            raised.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert started.wait(10)
    began = time.monotonic()
    ledger.close()
    caller.join(JOIN)
    assert not caller.is_alive() and time.monotonic() - began < 15
    assert (
        len(raised) == 1 and isinstance(raised[0], LedgerError) and "closed while" in str(raised[0])
    )
    with SyncLedger.open(db_url, call_timeout=CALL_TIMEOUT) as again:
        assert again.load_session("closing").state == "cancelled"


# ------------------------------------------------------------------------ interruption
INTERRUPTED = r"""
import asyncio, signal, sys, threading, time
from sessions.ledger.sync import SyncLedger

def interrupt_soon(delay):
    main = threading.main_thread().ident
    threading.Timer(delay, lambda: signal.pthread_kill(main, signal.SIGINT)).start()

def ident(uid):
    return {"uid": uid, "session_index": 0, "group_size": 1, "partition": "train", "global_step": 0}

with SyncLedger.open(sys.argv[1], call_timeout=60) as ledger:
    session = ledger.create_session("open-one", **ident("u1"))
    interrupt_soon(0.5)
    began = time.monotonic()
    try:
        ledger.batch("train", 0, timeout=45)   # waits on a group that never settles
    except KeyboardInterrupt:
        print("batch interrupted after %.1fs" % (time.monotonic() - began))
    session.record_trajectory(prompt_ids=[1], response_ids=[2])
    session.complete()
    print("batch rows", ledger.batch("train", 0, timeout=10).batch_size[0])

    async def runner(s):
        await s.record_trajectory(prompt_ids=[1], response_ids=[2])
        await asyncio.sleep(45)
    interrupt_soon(0.5)
    try:
        ledger.run_session(runner, "run-one", **ident("u2"))
    except KeyboardInterrupt:
        print("run_session interrupted, state", ledger.load_session("run-one").state)
print("threads", sorted(t.name for t in threading.enumerate() if t.name == "rollout-ledger-loop"))
"""


def test_ctrl_c_in_a_blocking_call_cancels_it_and_leaves_the_ledger_serving(db_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, db_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=default_sigint,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        lines[0].startswith("batch interrupted after") and float(lines[0].split()[-1][:-1]) < 5
    ), lines
    assert lines[1:] == [
        "batch rows 1",
        "run_session interrupted, state cancelled",
        "threads []",
    ], lines


def test_ctrl_c_inside_a_session_block_cancels_the_session(ledger: SyncLedger) -> None:
    with pytest.raises(KeyboardInterrupt):
        with ledger.session("kb", **identity("kb", 0, 1, 13)) as session:
            session.record_trajectory(**trajectory())
            raise KeyboardInterrupt
    assert session.state == "cancelled"
    assert scalar_metrics(ledger, "train", 13)["sessions/cancelled"] == 1


# ------------------------------------------------------------------------ metrics_dict
def test_metrics_dict_is_the_async_ledgers_own_through_every_face(ledger: SyncLedger) -> None:
    for index, outcome in enumerate(["ok", "error", "ok_half", "cancel"]):
        record_blocking(
            ledger,
            f"md{index}",
            outcome,
            **identity("md", index, 4, 14, partition="val", data_source="toy"),
        )

    async def straight() -> dict[str, float]:
        return await ledger.ledger.metrics_dict("val", 14)

    blocking = ledger.metrics_dict("val", 14, timeout=30)
    # verl's headline for a uid that lost a session: mean@3 over its rows, the failure as a zero
    assert blocking["val-core/toy/reward/mean@3"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert blocking["ledger/val/toy/reward/mean@3"] == pytest.approx(
        blocking["val-core/toy/reward/mean@3"]
    )
    assert blocking == ledger._call(straight(), "metrics_dict")
    assert asyncio.run(ledger.ametrics_dict("val", 14)) == blocking
    with pytest.raises(TimeoutError, match="no sessions"):
        ledger.metrics_dict("val", 15, timeout=0.2)


# ------------------------------------------------------------------- interpreter exit (issue 39)
AT_EXIT = """
import gc, sys, threading
from sessions import SyncLedger

url, ending = sys.argv[1], sys.argv[2]
ledger = SyncLedger.open(url, run="at-exit", call_timeout=60)
for index in range(3):
    with ledger.session(f"done-{index}", uid="u", session_index=index, group_size=4,
                        partition="train", global_step=0) as session:
        session.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4 + index])
        session.post_reward(float(index))
left_open = ledger.create_session("left-open", uid="u", session_index=3, group_size=4,
                                  partition="train", global_step=0)
left_open.record_trajectory(prompt_ids=[1, 2], response_ids=[9])
if ending in ("closed", "closed-twice"):
    ledger.close()
if ending == "closed-twice":
    ledger.close()
if ending == "collected":
    del ledger, left_open, session  # every face holds its SyncLedger
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name == "rollout-ledger-loop"], "not collected"
print("recorded")
"""


@pytest.mark.parametrize("ending", ["never-closed", "closed", "closed-twice", "collected"])
def test_interpreter_exit_closes_the_ledger_quietly_and_keeps_what_was_recorded(
    db_url: str, ending: str
) -> None:
    """`docs/trl.md`'s setup never closes its SyncLedger: the interpreter's exit does, before
    Python's thread pools stop taking work (the SQLite writer closes through one), so the run ends
    without a traceback on stderr, an explicit close before exit is not repeated, and every
    event recorded is committed (a session left open stays open, its trajectory kept)."""
    done = subprocess.run(
        [sys.executable, "-c", AT_EXIT, db_url, ending],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "recorded\n", "")
    with SyncLedger.open(db_url, run="at-exit", call_timeout=CALL_TIMEOUT) as reader:
        states = {
            session_id: reader.load_session(session_id).state
            for session_id in ("done-0", "done-1", "done-2", "left-open")
        }
        assert states == {
            "done-0": "succeeded",
            "done-1": "succeeded",
            "done-2": "succeeded",
            "left-open": "running",
        }
        assert reader.load_session("left-open").view.trajectories, "its trajectory was lost"
        counts = scalar_metrics(reader, "train", 0)
        assert (counts["sessions/succeeded"], counts["sessions/open"]) == (3.0, 1.0)
        assert counts["reward/sum"] == 3.0


AFTER_MAIN = """
import sys, threading
from sessions import SyncLedger

ledger = SyncLedger.open(sys.argv[1], run="after-main", call_timeout=60)


def worker():
    threading.main_thread().join()  # returns once the exit hooks have run: record after them
    for index in range(4):
        with ledger.session(f"late-{index}", uid="u", session_index=index, group_size=4,
                            partition="train", global_step=0) as session:
            session.record_trajectory(prompt_ids=[1, 2], response_ids=[3])
            session.post_reward(1.0)
    print("worker recorded", flush=True)


threading.Thread(target=worker).start()  # not a daemon: the interpreter waits for it
print("main done", flush=True)
"""


def test_a_thread_still_recording_when_the_main_thread_ends_keeps_its_ledger(
    pg_url: str,
) -> None:
    """The exit hook closes nothing while another non-daemon thread runs (the interpreter will
    wait for it, and it may be recording): that thread records after the hooks have run, and the
    SyncLedger closes at `atexit` once it has ended. (PostgreSQL: on SQLite every append goes
    through a thread pool, which Python stops taking work at the same hook, whatever the ledger
    does.)"""
    done = subprocess.run(
        [sys.executable, "-c", AFTER_MAIN, pg_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        "main done\nworker recorded\n",
        "",
    )
    with SyncLedger.open(pg_url, run="after-main", call_timeout=CALL_TIMEOUT) as reader:
        assert scalar_metrics(reader, "train", 0)["sessions/succeeded"] == 4.0
