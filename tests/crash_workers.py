"""Worker processes for the crash tests (tests/runs/test_crash_recovery.py).

A *zygote* process, spawned once per test, imports everything a worker needs (SQLAlchemy, the
drivers, torch for the sink's rows) and then forks one child per job, so a child is ready in
milliseconds instead of the seconds a fresh interpreter takes. The zygote also delivers the
SIGKILL: it is the children's parent, so it reaps them itself and a pid can never be reused
(and killed) by mistake.

Jobs:

- `writer`: a `Ledger` running sessions through `run_session` and `session()`, many at once, in
  groups of 1–4 (eight a step, their uids used again at every step, as dataset prompt ids are:
  a group is (run, partition, global_step, uid)), with every outcome the recorder knows (success, runner error, sandbox error,
  timeout, empty output, invalid output, cancellation). The plan of a session is the last part of
  its id, so the parent can tell what its stream must look like. After each command the writer's
  runner acknowledges, it appends `<session> <durable version>` to a journal (and `<session> end
  <state>` once `run_session`/`session()` returned): what the writer was told is durable. Their
  handles stage trajectories and rewards for the session's next durable command, so a session
  the kill left open stands at a durable command (`check_streams` asserts it).
- `projector`: `Projector.follow` with a small page size and, optionally, a `FileSink`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

#: plan -> the event types of a session that ran it to the end.
PLANS: dict[str, tuple[str, ...]] = {
    "ok": (
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "RewardPosted",
        "SessionSucceeded",
    ),
    "two": (
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "TrajectoryRecorded",
        "RewardPosted",
        "SessionSucceeded",
    ),
    "noreward": ("SessionCreated", "SessionStarted", "TrajectoryRecorded", "SessionSucceeded"),
    "raise": (
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "SessionFailed",
        "PlaceholderEmitted",
    ),
    "sandbox": (
        "SessionCreated",
        "SessionStarted",
        "TrajectoryRecorded",
        "SessionFailed",
        "PlaceholderEmitted",
    ),
    "timeout": ("SessionCreated", "SessionStarted", "SessionFailed", "PlaceholderEmitted"),
    "empty": ("SessionCreated", "SessionStarted", "SessionFailed", "PlaceholderEmitted"),
    "invalid": ("SessionCreated", "SessionStarted", "SessionFailed", "PlaceholderEmitted"),
    "cancel": ("SessionCreated", "SessionStarted", "TrajectoryRecorded", "SessionCancelled"),
}
#: plan -> (terminal state, failure reason)
OUTCOMES: dict[str, tuple[str, str | None]] = {
    "ok": ("succeeded", None),
    "two": ("succeeded", None),
    "noreward": ("succeeded", None),
    "raise": ("failed", "runner_error"),
    "sandbox": ("failed", "sandbox_error"),
    "timeout": ("failed", "timeout"),
    "empty": ("failed", "empty_output"),
    "invalid": ("failed", "invalid_output"),
    "cancel": ("cancelled", None),
}
PLAN_WEIGHTS = {
    "ok": 6,
    "two": 2,
    "noreward": 1,
    "raise": 2,
    "sandbox": 1,
    "timeout": 1,
    "empty": 1,
    "invalid": 1,
    "cancel": 1,
}
PROMPT = list(range(1, 9))


def plan_of(session_id: str) -> str:
    return session_id.rsplit("-", 1)[1]


# ------------------------------------------------------------------------------- the sink
class FileSink:
    """An external queue in a file: one JSON line per delivered item, appended with one write per
    put (a crash can cut only the last line, which the next opener terminates)."""

    def __init__(self, path: str, *, ack_delay: float = 0.0) -> None:
        self.ack_delay = (
            ack_delay  # a remote queue's round trip: widens the window before the checkpoint
        )
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self.fd).st_size
        if size:
            with open(path, "rb") as existing:
                existing.seek(size - 1)
                if existing.read(1) != b"\n":
                    os.write(self.fd, b"\n")

    async def put(self, items: Sequence[Any]) -> None:
        lines = [
            json.dumps(
                {
                    "run": i.run,
                    "partition": i.partition,
                    "global_step": i.global_step,
                    "key": i.key,
                    "uid": i.uid,
                    "kind": "tag" if i.is_tag else "row",
                    "status": i.tags.get("status"),
                }
            )
            + "\n"
            for i in items
        ]
        if lines:
            os.write(self.fd, "".join(lines).encode())
        if self.ack_delay:
            await asyncio.sleep(self.ack_delay)

    def close(self) -> None:
        os.close(self.fd)


def read_sink(path: str) -> list[dict[str, Any]]:
    """The delivered items in order (a line cut by a kill is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as handle:
        for line in handle:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


# ------------------------------------------------------------------------------- the jobs
async def writer(
    url: str, prefix: str, seed: int, journal: str, concurrency: int = 12, sessions: int = 2000
) -> None:
    from sessions import InvalidInput, Ledger, SandboxError

    rng = random.Random(seed)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def ack(text: str) -> None:
        os.write(fd, (text + "\n").encode())

    async def pause() -> None:
        await asyncio.sleep(rng.uniform(0, 0.004))

    async def trajectory(handle: Any) -> None:
        response = [rng.randrange(1, 50_000) for _ in range(rng.randint(4, 48))]
        await handle.record_trajectory(
            prompt_ids=PROMPT, response_ids=response, num_turns=rng.randint(1, 3)
        )
        ack(f"{handle.session_id} {handle.durable_version}")

    async def runner(plan: str, handle: Any) -> None:
        await pause()
        if plan == "timeout":
            await asyncio.sleep(30)
        if plan == "invalid":
            await handle.record_trajectory(
                prompt_ids=PROMPT, response_ids=[1, 2], response_mask=[1, 2]
            )
        if plan == "empty":
            return
        await trajectory(handle)
        await pause()
        if plan == "two":
            await trajectory(handle)
        if plan == "raise":
            raise RuntimeError("the runner blew up")
        if plan == "sandbox":
            raise SandboxError("the sandbox went away")
        if plan == "cancel":
            await handle.cancel("stopped by the runner")
            ack(f"{handle.session_id} {handle.durable_version}")
            return
        if plan != "noreward":
            await handle.post_reward(float(rng.random() < 0.5), acc=1.0)
            ack(f"{handle.session_id} {handle.durable_version}")

    plans, weights = zip(*PLAN_WEIGHTS.items())
    limit = asyncio.Semaphore(concurrency)

    async def one(sid: str, plan: str, uid: str, index: int, size: int, step: int) -> None:
        kwargs = dict(
            uid=uid,
            session_index=index,
            group_size=size,
            partition="val" if step % 2 else "train",
            global_step=step,
            data_source="crash",
        )
        try:
            if rng.random() < 0.5:
                outcome = await ledger.run_session(
                    lambda h: runner(plan, h),
                    sid,
                    timeout=0.05 if plan == "timeout" else 5.0,
                    **kwargs,
                )
                ack(f"{sid} end {outcome.state}")
            else:
                try:
                    async with ledger.session(sid, **kwargs) as handle:
                        ack(f"{sid} {handle.durable_version}")
                        if plan == "timeout":
                            raise TimeoutError("the episode ran out of time")
                        await runner(plan, handle)
                except (RuntimeError, SandboxError, TimeoutError, InvalidInput):
                    pass
                ack(f"{sid} end {handle.state}")
        finally:
            limit.release()

    async with Ledger.open(url, migrate=False, run="crash") as ledger:
        tasks = []
        counter = itertools.count()
        for group in itertools.count():
            size = 1 + group % 4
            for index in range(size):
                n = next(counter)
                if n >= sessions:
                    break
                plan = rng.choices(plans, weights)[0]
                await limit.acquire()
                # eight groups a step, their uids used again at every step: (run, partition, step, uid) is the group
                uid = f"{prefix}g{group % 8}"
                tasks.append(
                    asyncio.ensure_future(
                        one(f"{prefix}-{n}-{plan}", plan, uid, index, size, group // 8)
                    )
                )
            else:
                continue
            break
        await asyncio.gather(*tasks)
    os.close(fd)


async def projector(url: str, page_size: int, sink: str | None, poll: float = 0.01) -> None:
    from sessions.projection.projector import Projector
    from store import create_engine

    engine = create_engine(url)
    sinks = [FileSink(sink, ack_delay=0.01)] if sink else []
    try:
        await Projector(engine, sinks=sinks, page_size=page_size).follow(
            asyncio.Event(), poll_interval=poll
        )
    finally:
        await engine.dispose()


async def stale(url: str) -> None:
    """Leave sessions open the way a crashed runner host does, then die by SIGKILL.

    Run `stale`, val step 0, group `old` of 3: `old-0` created but never started, `old-1` running
    with a trajectory, `old-2` succeeded.
    """
    from sessions import Ledger

    async with Ledger.open(url, migrate=False, run="stale") as ledger:
        kw = dict(uid="old", group_size=3, partition="val", global_step=0, data_source="stale")
        await ledger.create_session("old-0", session_index=0, start=False, **kw)
        running = await ledger.create_session("old-1", session_index=1, **kw)
        await running.record_trajectory(prompt_ids=PROMPT, response_ids=[5, 6, 7])
        async with ledger.session("old-2", session_index=2, **kw) as done:
            await done.record_trajectory(prompt_ids=PROMPT, response_ids=[8, 9])
            await done.post_reward(1.0)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no dispose: the process just vanishes


JOBS = {"writer": writer, "projector": projector, "stale": stale}


# ------------------------------------------------------------------------------- the zygote
def _child(job: str, kwargs: dict[str, Any], errors: str) -> None:
    """Runs in the forked child; never returns."""
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        asyncio.run(JOBS[job](**kwargs))
    except BaseException:  # noqa: BLE001 - reported to the parent through the errors file
        with open(errors, "a") as out:
            out.write(f"--- {job} ({os.getpid()})\n{traceback.format_exc()}")
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_jobs(
    jobs: list[tuple[str, dict[str, Any], float | None]], errors: str, limit: float
) -> list[dict[str, Any]]:
    """Fork a child per job; SIGKILL each at its time unless it ended; reap all."""
    started = time.monotonic()
    children = []
    for job, kwargs, kill_after in jobs:
        pid = os.fork()
        if pid == 0:
            _child(job, kwargs, errors)
        children.append(
            {"job": job, "pid": pid, "kill_after": kill_after, "killed": False, "status": None}
        )
    while any(c["status"] is None for c in children):
        now = time.monotonic() - started
        for child in children:
            if child["status"] is not None:
                continue
            pid, status = os.waitpid(child["pid"], os.WNOHANG)
            if pid:
                child["status"], child["ran"] = status, now
                continue
            due = child["kill_after"] if child["kill_after"] is not None else limit
            if now >= due:
                os.kill(child["pid"], signal.SIGKILL)
                child["killed"] = True
                _pid, child["status"] = os.waitpid(child["pid"], 0)
                child["ran"] = now
        time.sleep(0.002)
    return [
        {
            "job": c["job"],
            "killed": c["killed"] and os.WIFSIGNALED(c["status"]),
            "ran": round(c["ran"], 3),
            "exit": os.WEXITSTATUS(c["status"])
            if os.WIFEXITED(c["status"])
            else -os.WTERMSIG(c["status"]),
        }
        for c in children
    ]


def zygote(conn: Any) -> None:
    """Target of a 'spawn' Process: preload, then serve `(jobs, errors_path, limit)` requests."""
    import aiosqlite  # noqa: F401
    import sqlalchemy.dialects.sqlite.aiosqlite  # noqa: F401

    import sessions  # noqa: F401
    import sessions.audit.auditing  # noqa: F401
    import sessions.batches.rows  # noqa: F401  (torch, for the sink's rows)
    import sessions.projection.projector  # noqa: F401
    import store  # noqa: F401

    try:
        import asyncpg  # noqa: F401
        import sqlalchemy.dialects.postgresql.asyncpg  # noqa: F401
    except ImportError:
        pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        jobs, errors, limit = request
        try:
            conn.send(("done", _run_jobs(jobs, errors, limit)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------------- invariants
# Shared by tests/runs/test_crash_recovery.py and tests/test_fuzz.py: what must hold of any database, whatever
# killed or faulted its writers and projectors. Each raises AssertionError naming what broke.
TERMINAL = ("SessionSucceeded", "SessionFailed", "SessionCancelled")
#: what `run_session` and `session()` handles stage for the session's next durable command
STAGED = ("TrajectoryRecorded", "RewardPosted")
SETTLING = ("SessionSucceeded", "SessionCancelled", "PlaceholderEmitted")


async def log_streams(engine: Any) -> dict[str, list[tuple[int, int, str, dict[str, Any]]]]:
    """session -> [(position, version, type, data)] in position order (the runs' configuration
    streams, `@run:<run>`, are no sessions and are left out)."""
    from sqlalchemy import select

    from store.schema.tables import events

    streams: dict[str, list[tuple[int, int, str, dict[str, Any]]]] = {}
    async with engine.connect() as conn:
        query = select(
            events.c.position, events.c.session_id, events.c.version, events.c.type, events.c.data
        )
        for position, sid, version, type_, data in await conn.execute(
            query.order_by(events.c.position)
        ):
            if type_ != "RunConfigured":
                streams.setdefault(sid, []).append((position, version, type_, data))
    return streams


def check_streams(
    streams: dict[str, list[tuple[int, int, str, dict[str, Any]]]], *, plans: bool = False
) -> dict[str, Any]:
    """docs/design.md §3–5 per session: versions 1..n in position order, SessionCreated first, at most one
    terminal event, a SessionFailed followed at once by its PlaceholderEmitted (when its recorded
    decision is `emit`) and nothing else after the end. With `plans`, the session id names its
    plan (`PLANS`): a terminal stream is the whole plan, an open one a prefix of it that ends at a
    durable command — a staged trajectory or reward is written with the command after it, never
    alone (a kill between them leaves the session as its last durable command did)."""
    open_ids, ends = [], {"succeeded": 0, "failed": 0, "cancelled": 0}
    for sid, stream in streams.items():
        versions = [v for _, v, _, _ in stream]
        types = [t for _, _, t, _ in stream]
        assert versions == list(range(1, len(stream) + 1)), (
            f"{sid}: versions {versions} are not 1..n in log order"
        )
        assert types[0] == "SessionCreated" and types.count("SessionCreated") == 1, (
            f"{sid}: {types}"
        )
        terminals = [i for i, t in enumerate(types) if t in TERMINAL]
        assert len(terminals) <= 1, f"{sid}: {len(terminals)} terminal events: {types}"
        if not terminals:
            assert "PlaceholderEmitted" not in types, (
                f"{sid}: placeholder without a failure: {types}"
            )
            open_ids.append(sid)
        else:
            end = terminals[0]
            tail = types[end + 1 :]
            if (
                types[end] == "SessionFailed"
                and stream[end][3].get("placeholder", "emit") == "emit"
            ):
                assert tail == ["PlaceholderEmitted"], (
                    f"{sid}: SessionFailed must be followed by exactly its placeholder: {types}"
                )
            else:
                assert tail == [], f"{sid}: events after {types[end]}: {types}"
            ends[
                {
                    "SessionSucceeded": "succeeded",
                    "SessionFailed": "failed",
                    "SessionCancelled": "cancelled",
                }[types[end]]
            ] += 1
        if plans:
            plan = plan_of(sid)
            want = PLANS[plan]
            if terminals:
                if (
                    types[terminals[0]] == "SessionFailed"
                    and stream[terminals[0]][3]["reason"] == "orphaned"
                ):
                    assert tuple(types[: terminals[0]]) == want[: terminals[0]], (
                        f"{sid} ({plan}): {types}"
                    )
                else:
                    assert tuple(types) == want, (
                        f"{sid} ({plan}) ended as {types}, its plan is {want}"
                    )
                    state, reason = OUTCOMES[plan]
                    if reason is not None:
                        assert stream[terminals[0]][3]["reason"] == reason, (
                            f"{sid} ({plan}): {stream[terminals[0]][3]}"
                        )
            else:
                assert tuple(types) == want[: len(types)], (
                    f"{sid} ({plan}) open with {types}, not a prefix of {want}"
                )
            cut = types[: terminals[0]] if terminals else types
            orphaned = bool(terminals) and stream[terminals[0]][3].get("reason") == "orphaned"
            if not terminals or orphaned:
                assert cut[-1] not in STAGED, (
                    f"{sid} ({plan}): a staged {cut[-1]} was written without the command after "
                    f"it: {types}"
                )
    return {"open": open_ids, "ends": ends, "sessions": len(streams)}


def check_journal(path: str, streams: dict[str, list[tuple[int, int, str, dict[str, Any]]]]) -> int:
    """Everything the writer was told had committed is in the log: acknowledged = durable."""
    if not os.path.exists(path):
        return 0
    acks = 0
    with open(path) as handle:
        for line in handle:
            parts = line.split()
            if not line.endswith("\n") or len(parts) not in (2, 3):
                continue  # cut by the kill
            sid = parts[0]
            stream = streams.get(sid, [])
            if len(parts) == 2:
                assert len(stream) >= int(parts[1]), (
                    f"{sid}: acknowledged version {parts[1]}, the log has {len(stream)} events"
                )
            else:
                state = {
                    "SessionSucceeded": "succeeded",
                    "SessionFailed": "failed",
                    "SessionCancelled": "cancelled",
                }
                ended = [state[t] for _, _, t, _ in stream if t in state]
                assert ended == [parts[2]], (
                    f"{sid}: the writer saw it end {parts[2]}, the log says {ended}"
                )
            acks += 1
    return acks


async def check_projection(
    engine: Any, streams: dict[str, list[tuple[int, int, str, dict[str, Any]]]] | None = None
) -> dict[str, Any]:
    """The read models at the checkpoint against the log up to it, and against themselves:
    every queue row exactly once (unique keys; as many as the sessions table and the log call
    for, per session too), a group tag only for a settled group and never before its rows,
    metric counters equal to a brute-force count of sessions by state."""
    from sqlalchemy import select

    from store.schema.tables import checkpoints, groups, metric_counts, queue_rows, sessions

    if streams is None:
        streams = await log_streams(engine)
    async with engine.connect() as conn:
        checkpoint = (
            await conn.execute(
                select(checkpoints.c.position).where(checkpoints.c.name == "projector")
            )
        ).scalar() or 0
        queue = [dict(r) for r in (await conn.execute(select(queue_rows))).mappings()]
        session_rows = {
            r["session_id"]: dict(r) for r in (await conn.execute(select(sessions))).mappings()
        }
        group_rows = {
            group_key(r): dict(r) for r in (await conn.execute(select(groups))).mappings()
        }
        metrics = {
            (r["run"], r["partition"], r["global_step"], r["metric"]): r["value"]
            for r in (
                await conn.execute(
                    select(metric_counts).where(metric_counts.c.data_source.is_(None))
                )
            ).mappings()
        }
    keys = [queue_key(q) for q in queue]
    assert len(keys) == len(set(keys)), "a queue key appears twice"
    rows = [q for q in queue if q["kind"] == "row"]
    tags = [q for q in queue if q["kind"] == "tag"]

    # the log up to the checkpoint
    seen = {sid: [e for e in stream if e[0] <= checkpoint] for sid, stream in streams.items()}
    seen = {sid: stream for sid, stream in seen.items() if stream}
    assert set(seen) == set(session_rows), (
        f"sessions table {len(session_rows)} vs log {len(seen)}: {sorted(set(seen) ^ set(session_rows))[:5]}"
    )
    from_log = {
        sid: sum(
            len(d["selected"]) if t == "SessionSucceeded" else t == "PlaceholderEmitted"
            for _, _, t, d in stream
        )
        for sid, stream in seen.items()
    }
    per_session: dict[str, int] = {}
    for q in rows:
        per_session[q["session_id"]] = per_session.get(q["session_id"], 0) + 1
    for sid, s in session_rows.items():
        assert per_session.get(sid, 0) == s["selected_rows"] == from_log[sid], (
            f"{sid}: {per_session.get(sid, 0)} queue rows, selected_rows {s['selected_rows']}, log says {from_log[sid]}"
        )
        state = {
            "SessionSucceeded": "succeeded",
            "SessionFailed": "failed",
            "SessionCancelled": "cancelled",
        }
        ended = [state[t] for _, _, t, _ in seen[sid] if t in state]
        started = any(t == "SessionStarted" for _, _, t, _ in seen[sid])
        want_state = ended[0] if ended else ("running" if started else "created")
        assert s["state"] == want_state, f"{sid}: state {s['state']} but the log says {want_state}"

    # groups: settled iff group_size of its sessions settled in the log; tag after every row
    members: dict[tuple[Any, ...], list[str]] = {}
    for sid, s in session_rows.items():
        members.setdefault(group_key(s), []).append(sid)
    tag_at = {group_key(q): q for q in tags}
    for key, group in group_rows.items():
        settled = sum(
            any(
                t in SETTLING or (t == "SessionFailed" and d.get("placeholder") == "drop")
                for _, _, t, d in seen[sid]
            )
            for sid in members.get(key, [])
        )
        want = settled >= group["group_size"]
        assert (group["status"] != "pending") == want, (
            f"group {key}: status {group['status']} with {settled}/{group['group_size']} settled"
        )
        assert (key in tag_at) == want, f"group {key}: tag present {key in tag_at}, settled {want}"
        if want:
            succeeded = any(session_rows[sid]["state"] == "succeeded" for sid in members[key])
            assert group["status"] == ("finished" if succeeded else "failure"), (
                f"group {key}: {group['status']}"
            )
            assert tag_at[key]["tags"]["status"] == group["status"]
            row_positions = [q["produced_position"] for q in rows if group_key(q) == key]
            assert all(p <= tag_at[key]["produced_position"] for p in row_positions), (
                f"group {key}: tag before a row"
            )

    # metrics: counters equal a brute-force count of the sessions table
    brute: dict[tuple[str, str, int | None], dict[str, float]] = {}
    for s in session_rows.values():
        b = brute.setdefault((s["run"], s["partition"], s["global_step"]), {})
        b["sessions/total"] = b.get("sessions/total", 0) + 1
        if s["state"] in ("succeeded", "failed", "cancelled"):
            b[f"sessions/{s['state']}"] = b.get(f"sessions/{s['state']}", 0) + 1
        else:
            b["sessions/open"] = b.get("sessions/open", 0) + 1
        if s["state"] == "failed":
            name = f"failed/{s['failure_reason']}"
            b[name] = b.get(name, 0) + 1
        b["placeholders"] = b.get("placeholders", 0) + bool(s["placeholder"])
        b["rows/total"] = b.get("rows/total", 0) + s["selected_rows"]
    for g in group_rows.values():
        b = brute.setdefault((g["run"], g["partition"], g["global_step"]), {})
        b["groups/total"] = b.get("groups/total", 0) + 1
        if g["status"] != "pending":
            b[f"groups/{g['status']}"] = b.get(f"groups/{g['status']}", 0) + 1
    for (run, partition, step), counts in brute.items():
        for name in (
            "sessions/total",
            "sessions/succeeded",
            "sessions/failed",
            "sessions/cancelled",
            "sessions/open",
            "placeholders",
            "rows/total",
            "groups/total",
            "groups/finished",
            "groups/failure",
            *[k for k in counts if k.startswith("failed/")],
        ):
            found = metrics.get((run, partition, step, name), 0.0)
            assert found == counts.get(name, 0), (
                f"metric {name} of {run}/{partition}/step {step}: {found}, counted {counts.get(name, 0)}"
            )
    return {
        "checkpoint": checkpoint,
        "rows": len(rows),
        "tags": len(tags),
        "keys": {queue_key(q) for q in queue},
        "pending_groups": sum(g["status"] == "pending" for g in group_rows.values()),
        "row_keys_by_group": {
            key: {queue_key(q) for q in rows if group_key(q) == key} for key in group_rows
        },
    }


def group_key(row: Any) -> tuple[Any, ...]:
    """A group's identity (docs/design.md §2): a uid that comes back at a later step is a new group."""
    return (row["run"], row["partition"], row["global_step"], row["uid"])


def queue_key(row: Any) -> tuple[Any, ...]:
    """A queue row's or sink item's identity: keys are unique per (run, partition, global_step)."""
    return (row["run"], row["partition"], row["global_step"], row["key"])


def check_sink(path: str, projection: dict[str, Any], *, exact: bool = True) -> int:
    """The external sink got every committed key (at least once) and — when the projector is at
    rest after a successful page (`exact`) — nothing else, and a group's tag never reached it
    before the group's rows. Returns the number of re-deliveries."""
    delivered = read_sink(path)
    first: dict[tuple[str, str, str], int] = {}
    for index, item in enumerate(delivered):
        first.setdefault(queue_key(item), index)
    missing = projection["keys"] - set(first)
    assert not missing, f"committed queue keys the sink never got: {sorted(missing)[:5]}"
    if exact:
        assert set(first) == projection["keys"], (
            f"sink keys never committed: {sorted(set(first) - projection['keys'])[:5]}"
        )
    for item in delivered:
        if item["kind"] == "tag":
            key = queue_key(item)
            rows = projection["row_keys_by_group"].get(group_key(item), set())
            late = [r for r in rows if first.get(r, len(delivered)) > first[key]]
            assert not late, f"sink got the tag of {item['uid']} before its rows {late[:3]}"
    return len(delivered) - len(first)
