"""Stateful fuzzing of the public API (hypothesis `RuleBasedStateMachine`), on SQLite and PostgreSQL.

Random interleavings of: create sessions in random groups (started or not), record, post
rewards, complete, fail, cancel, `start`, raise inside `session()`, `run_session` (success,
exception, timeout, empty), stale handles, project through a sink that sometimes fails (before
or after delivering), an append that hits an injected disk-full error, restart (close and reopen
on the same file) and `recover`. A model of every session's state runs alongside.

After every step (docs/design.md §3–7): each stream is whole (versions 1..n, one SessionCreated, at most
one terminal event, a failed session followed by exactly one placeholder under the default
policy) and agrees with the model; the read models at the checkpoint agree with the log (no group
tag before its rows or before its group settled, every queue row exactly once, metric counters
equal to a brute-force count by state); every committed queue key reached the sink, and after a
successful projection nothing else did. Each run ends with `audit` passing.

Each backend has one database for the module, wiped at the start of every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import event

from sessions import (
    ConcurrencyError,
    InvalidInput,
    InvalidTransition,
    Ledger,
    SandboxError,
    StoreError,
)
from sessions.audit.auditing import audit
from sessions.runs.recovery import recover
from tests import crash_workers as cw
from tests.conftest import backend_of, wipe

OPEN = ("created", "running")
REASONS = (
    "runner_error",
    "timeout",
    "sandbox_error",
    "finalize_error",
    "invalid_output",
    "empty_output",
)
RAISED = {
    "runtime": ("runner_error", RuntimeError),
    "sandbox": ("sandbox_error", SandboxError),
    "timeout": ("timeout", TimeoutError),
    "invalid": ("invalid_output", None),
}
#: What each backend's driver says when the disk is full (the fault the fuzzer injects at append).
DISK_FULL = {
    "sqlite": "database or disk is full",
    "postgresql": "could not extend file: No space left on device",
}


class Injected(RuntimeError):
    """A sink failure injected by the fuzzer."""


class FlakyFileSink(cw.FileSink):
    """The crash tests' file sink; fails the next put when armed, before or after delivering."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.armed: str | None = None

    async def put(self, items: Any) -> None:
        mode, self.armed = self.armed, None
        if mode == "before":
            raise Injected("sink refused the page")
        await super().put(items)
        if mode == "after":
            raise Injected("sink delivered, then the acknowledgement was lost")


class LedgerMachine(RuleBasedStateMachine):
    #: The database each run wipes and uses (set per backend by `test_ledger_fuzz`).
    database: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.folder = Path(tempfile.mkdtemp(prefix="rl-fuzz-"))
        self.url = self.database
        self.run(wipe(self.url))
        self.sink_path = str(self.folder / "sink.jsonl")
        self.sink = FlakyFileSink(self.sink_path)
        self.stack: contextlib.AsyncExitStack | None = None
        self.ledger: Ledger | None = None
        self.disk_full = False
        self.state: dict[str, str] = {}  # model: session -> state
        self.reason: dict[str, str | None] = {}
        self.trajectories: dict[str, int] = {}
        self.scope: dict[str, tuple[str, int]] = {}
        self.groups: dict[str, dict[str, Any]] = {}  # uid -> {"size", "members"}
        self.handles: dict[str, Any] = {}
        self.counter = 0
        self.at_rest = (
            True  # the sink holds exactly the committed keys (no delivery was left uncommitted)
        )

    # ------------------------------------------------------------------ plumbing
    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _open(self) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.ledger = await self.stack.enter_async_context(Ledger.open(self.url, sinks=[self.sink]))
        # on a SQLite file the inserts run on the append writer thread's own engine
        event.listen(self.ledger.store.append_engine, "before_cursor_execute", self._fault)
        self.handles = {}

    def _fault(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if self.disk_full and statement.lstrip().upper().startswith("INSERT INTO EVENTS"):
            self.disk_full = False
            dialect = self.ledger.store.append_engine.dialect  # type: ignore[union-attr]
            raise dialect.dbapi.OperationalError(DISK_FULL[dialect.name])

    async def _handle(self, sid: str) -> Any:
        if sid not in self.handles:
            self.handles[sid] = await self.ledger.load_session(sid)  # type: ignore[union-attr]
        return self.handles[sid]

    def _pick(self, pick: int, states: tuple[str, ...] | None = None) -> str | None:
        pool = sorted(s for s, state in self.state.items() if states is None or state in states)
        return pool[pick % len(pool)] if pool else None

    def _new(self, new_group: bool, size: int, pick: int) -> tuple[str, dict[str, Any]]:
        open_groups = sorted(uid for uid, g in self.groups.items() if len(g["members"]) < g["size"])
        if new_group or not open_groups:
            uid = f"g{self.counter}"
            self.groups[uid] = {
                "size": size,
                "members": [],
                "partition": ("train", "val")[self.counter % 2],
                "step": self.counter % 3,
            }
        else:
            uid = open_groups[pick % len(open_groups)]
        group = self.groups[uid]
        sid = f"s{self.counter}"
        self.counter += 1
        group["members"].append(sid)
        self.trajectories[sid] = 0
        self.reason[sid] = None
        self.scope[sid] = (group["partition"], group["step"])
        return sid, {
            "uid": uid,
            "session_index": len(group["members"]) - 1,
            "group_size": group["size"],
            "partition": group["partition"],
            "global_step": group["step"],
            "data_source": "fuzz",
        }

    def _end(self, sid: str, state: str, reason: str | None = None) -> None:
        self.state[sid] = state
        self.reason[sid] = reason

    async def _expect_refused(
        self, sid: str, command: Any, error: type[BaseException] = InvalidTransition
    ) -> None:
        ledger = self.ledger
        position = await ledger.store.last_position()  # type: ignore[union-attr]
        with pytest.raises(error):
            await command
        assert await ledger.store.last_position() == position  # type: ignore[union-attr]

    # ------------------------------------------------------------------ rules
    @initialize()
    def start_ledger(self) -> None:
        self.run(self._open())

    @rule(
        new_group=st.booleans(),
        size=st.integers(1, 3),
        pick=st.integers(0, 99),
        start=st.booleans(),
    )
    def create(self, new_group: bool, size: int, pick: int, start: bool) -> None:
        sid, kw = self._new(new_group, size, pick)
        self.handles[sid] = self.run(self.ledger.create_session(sid, start=start, **kw))  # type: ignore[union-attr]
        self.state[sid] = "running" if start else "created"

    @precondition(lambda self: self.state)
    @rule(pick=st.integers(0, 99), length=st.integers(1, 24), bad_mask=st.booleans())
    def record(self, pick: int, length: int, bad_mask: bool) -> None:
        sid = self._pick(pick)
        handle = self.run(self._handle(sid))
        mask = [2] * length if bad_mask else [1, 0] * (length // 2) + [1] * (length % 2)
        command = handle.record_trajectory(
            prompt_ids=[1, 2, 3], response_ids=list(range(5, 5 + length)), response_mask=mask
        )
        if bad_mask:  # input is checked before the state
            self.run(self._expect_refused(sid, command, InvalidInput))
        elif self.state[sid] != "running":
            self.run(self._expect_refused(sid, command))
        else:
            self.run(command)
            self.trajectories[sid] += 1

    @precondition(lambda self: self.state)
    @rule(pick=st.integers(0, 99), reward=st.one_of(st.none(), st.floats(-1, 1), st.just(math.nan)))
    def reward(self, pick: int, reward: float | None) -> None:
        sid = self._pick(pick)
        handle = self.run(self._handle(sid))
        command = handle.post_reward(reward, note="fuzz")
        if reward is not None and math.isnan(reward):
            self.run(self._expect_refused(sid, command, InvalidInput))
        elif self.state[sid] != "running":
            self.run(self._expect_refused(sid, command))
        else:
            self.run(command)

    @precondition(lambda self: self.state)
    @rule(pick=st.integers(0, 99))
    def start(self, pick: int) -> None:
        sid = self._pick(pick)
        handle = self.run(self._handle(sid))
        if self.state[sid] != "created":
            self.run(self._expect_refused(sid, handle.start()))
        else:
            self.run(handle.start())
            self.state[sid] = "running"

    @precondition(lambda self: self.state)
    @rule(pick=st.integers(0, 99))
    def complete(self, pick: int) -> None:
        sid = self._pick(pick)
        handle = self.run(self._handle(sid))
        if self.state[sid] != "running":
            self.run(self._expect_refused(sid, handle.complete()))
            return
        state = self.run(handle.complete())
        expected = "succeeded" if self.trajectories[sid] else "failed"
        assert state == expected
        self._end(sid, state, None if state == "succeeded" else "empty_output")

    @precondition(lambda self: self.state)
    @rule(pick=st.integers(0, 99), reason=st.sampled_from(REASONS))
    def fail(self, pick: int, reason: str) -> None:
        sid = self._pick(pick)
        handle = self.run(self._handle(sid))
        if self.state[sid] not in OPEN:
            self.run(self._expect_refused(sid, handle.fail(reason)))
            return
        self.run(handle.fail(reason, message="fuzzed"))
        self._end(sid, "failed", reason)

    @precondition(lambda self: self.state)
    @rule(pick=st.integers(0, 99))
    def cancel(self, pick: int) -> None:
        sid = self._pick(pick)
        handle = self.run(self._handle(sid))
        if self.state[sid] not in OPEN:
            self.run(self._expect_refused(sid, handle.cancel()))
            return
        self.run(handle.cancel("fuzzed"))
        self._end(sid, "cancelled")

    @rule(
        new_group=st.booleans(),
        size=st.integers(1, 3),
        pick=st.integers(0, 99),
        outcome=st.sampled_from(["ok", "empty", *RAISED]),
        records=st.integers(0, 2),
        via_run_session=st.booleans(),
    )
    def session_block(
        self,
        new_group: bool,
        size: int,
        pick: int,
        outcome: str,
        records: int,
        via_run_session: bool,
    ) -> None:
        """`session()` or `run_session`, ending normally or by an exception (or a real timeout)."""
        sid, kw = self._new(new_group, size, pick)
        ledger = self.ledger

        async def body(handle: Any) -> None:
            for _ in range(records):
                await handle.record_trajectory(prompt_ids=[1], response_ids=[2, 3])
            if outcome == "invalid":
                await handle.record_trajectory(prompt_ids=[], response_ids=[2])
            elif outcome == "timeout" and via_run_session:
                await asyncio.sleep(10)  # run_session's own timeout fires
            elif outcome in RAISED:
                raise RAISED[outcome][1]("fuzzed failure")

        async def go() -> None:
            if via_run_session:
                result = await ledger.run_session(
                    body, sid, timeout=0.05 if outcome == "timeout" else 10, **kw
                )
                assert result.state == self.state[sid], (result, self.state[sid])
                return
            try:
                async with ledger.session(sid, **kw) as handle:
                    await body(handle)
            except (RuntimeError, SandboxError, TimeoutError, InvalidInput):
                assert outcome in RAISED
            else:
                assert outcome not in RAISED

        if outcome in RAISED:
            self.state[sid], self.reason[sid] = "failed", RAISED[outcome][0]
        elif records:
            self.state[sid], self.reason[sid] = "succeeded", None
        else:
            self.state[sid], self.reason[sid] = "failed", "empty_output"
        self.trajectories[sid] = records
        self.run(go())

    @precondition(lambda self: any(s == "running" for s in self.state.values()))
    @rule(pick=st.integers(0, 99))
    def stale_handle(self, pick: int) -> None:
        sid = self._pick(pick, ("running",))
        stale = self.run(self.ledger.load_session(sid))  # type: ignore[union-attr]
        self.run(self.run(self._handle(sid)).post_reward(0.25))  # the live handle moves on
        self.run(self._expect_refused(sid, stale.post_reward(0.75), ConcurrencyError))

    @precondition(lambda self: any(s == "running" for s in self.state.values()))
    @rule(pick=st.integers(0, 99))
    def disk_full_on_append(self, pick: int) -> None:
        sid = self._pick(pick, ("running",))
        handle = self.run(self._handle(sid))
        version = handle.version
        self.disk_full = True
        self.run(
            self._expect_refused(
                sid, handle.record_trajectory(prompt_ids=[1], response_ids=[2]), StoreError
            )
        )
        assert handle.version == version and not self.disk_full

    @rule(fault=st.sampled_from([None, None, "before", "after"]))
    def project(self, fault: str | None) -> None:
        ledger = self.ledger
        before = self.run(cw.check_projection(ledger.engine))["checkpoint"]  # type: ignore[union-attr]
        end = self.run(ledger.store.last_position())  # type: ignore[union-attr]
        self.sink.armed = fault
        try:
            self.run(ledger.project())  # type: ignore[union-attr]
        except Injected:
            assert fault is not None and before < end
            after = self.run(cw.check_projection(ledger.engine))["checkpoint"]  # type: ignore[union-attr]
            assert after == before, "a failed page must not move the checkpoint"
            if fault == "after":
                self.at_rest = False  # delivered, not committed: re-delivered (by key) next time
            return
        finally:
            self.sink.armed = None
        assert (
            fault is None or before == end
        )  # an armed sink is only ever called with a page to put
        self.at_rest = True
        self.run(self._check_metrics_against_model())

    @rule()
    def restart(self) -> None:
        self.run(self.stack.aclose())  # type: ignore[union-attr]
        self.run(self._open())

    @rule()
    def sweep(self) -> None:
        failed = self.run(recover(self.ledger, timedelta(0)))  # projects first (sink not armed)
        assert sorted(failed) == sorted(s for s, state in self.state.items() if state in OPEN)
        for sid in failed:
            self._end(sid, "failed", "orphaned")
            self.handles.pop(sid, None)
        self.at_rest = True  # recover projected successfully before failing them

    # ------------------------------------------------------------------ invariants
    @invariant()
    def log_read_models_and_sink_agree(self) -> None:
        if self.ledger is None:
            return
        engine = self.ledger.engine
        streams = self.run(cw.log_streams(engine))
        facts = cw.check_streams(streams)
        assert sorted(streams) == sorted(self.state), (
            "every session the model knows is in the log, no other"
        )
        assert sorted(facts["open"]) == sorted(
            s for s, state in self.state.items() if state in OPEN
        )
        for sid, stream in streams.items():
            types = [t for _, _, t, _ in stream]
            state = self.state[sid]
            if state == "failed":
                failed = next(d for _, _, t, d in stream if t == "SessionFailed")
                assert failed["reason"] == self.reason[sid], (sid, failed, self.reason[sid])
                assert types.count("PlaceholderEmitted") == 1 and types[-1] == "PlaceholderEmitted"
            elif state in OPEN:
                assert ("SessionStarted" in types) == (state == "running"), (sid, types, state)
            else:
                assert (
                    types[-1]
                    == {"succeeded": "SessionSucceeded", "cancelled": "SessionCancelled"}[state]
                )
            assert types.count("TrajectoryRecorded") == self.trajectories[sid]
        projection = self.run(cw.check_projection(engine, streams))
        cw.check_sink(self.sink_path, projection, exact=self.at_rest)

    async def _check_metrics_against_model(self) -> None:
        """Right after a successful projection: metric counters vs the model's own count."""
        rows = await self.ledger.metrics(project=False)  # type: ignore[union-attr]
        found = {
            (r.partition, r.global_step, r.metric): r.value for r in rows if r.data_source is None
        }
        counted: dict[tuple[str, int, str], int] = {}
        for sid, state in self.state.items():
            partition, step = self.scope[sid]
            for name in (
                "sessions/total",
                f"sessions/{state}" if state not in OPEN else "sessions/open",
            ):
                counted[(partition, step, name)] = counted.get((partition, step, name), 0) + 1
            if state == "failed":
                for name in (f"failed/{self.reason[sid]}", "placeholders"):
                    counted[(partition, step, name)] = counted.get((partition, step, name), 0) + 1
        for key, value in counted.items():
            assert found.get(key, 0) == value, (
                f"metric {key}: stored {found.get(key)}, model {value}"
            )
        for (partition, step, name), value in found.items():
            if name.startswith(("sessions/", "failed/")) or name == "placeholders":
                assert value == counted.get((partition, step, name), 0), (
                    f"metric {name} {partition}/{step}: {value}"
                )

    def teardown(self) -> None:
        try:
            if self.ledger is not None:
                self.sink.armed = None
                self.run(self.ledger.project())
                report = self.run(audit(self.ledger.engine))
                assert report.ok, [str(d) for d in report.divergences[:3]]
        finally:
            if self.stack is not None:
                self.run(self.stack.aclose())
            self.sink.close()
            self.loop.close()
            shutil.rmtree(self.folder, ignore_errors=True)


#: Runs per backend: a PostgreSQL run costs about twice a SQLite one (round trips), so it has fewer.
EXAMPLES = {"sqlite": 20, "postgres": 10}


def test_ledger_fuzz(module_db_url: str) -> None:
    machine = type("LedgerFuzz", (LedgerMachine,), {"database": module_db_url})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES[backend_of(module_db_url)],
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
