"""Worker processes for the PostgreSQL scale-out tests (tests/store/test_postgres_scale_out.py).

multiprocessing's 'spawn' context imports its targets by name, so every worker is a top-level
function here. Each opens its own engine or `Ledger` (its own connections, its own event loop),
reports "ready" on a queue, waits for the common start signal, does its work and puts
("done", name, result) — or ("error", name, traceback) — on the queue.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import traceback
import uuid
from datetime import datetime, timezone
from typing import Any

#: A uid must not contain "_" (queue keys are `{uid}_{session_index}_{i}`).
PROMPT = list(range(1, 17))


def _report(queue: Any, name: str, body: Any) -> None:
    try:
        queue.put(("done", name, asyncio.run(body)))
    except BaseException:  # noqa: BLE001 - the parent must hear about any failure
        queue.put(("error", name, traceback.format_exc()))


def _wait(event: Any, timeout: float = 60.0) -> None:
    if not event.wait(timeout):
        raise TimeoutError("the start signal never came")


# ------------------------------------------------------------- raw appends (ordering)
def new_event(session_id: str, version: int, writer: str) -> Any:
    from store import NewEvent

    return NewEvent(
        event_id=str(uuid.uuid4()),
        session_id=session_id,
        version=version,
        type="Noted",
        schema_version=1,
        run="order",
        uid=session_id.replace("_", "-"),
        partition="train",
        global_step=0,
        data={"writer": writer, "v": version},
        payload=os.urandom(4096),
        recorded_at=datetime.now(timezone.utc),
    )


async def append_batches(
    url: str, writer: str, *, streams: int, appends: int, max_batch: int, seed: int
) -> list[list[str]]:
    """One writer with its own engine: `streams` sessions appended to concurrently, `appends`
    batches of 1..max_batch events in all. Returns each successful append's event ids in order."""
    from store import EventStore, create_engine

    engine = create_engine(url, pool_size=streams, max_overflow=0)
    store = EventStore(engine)
    rng = random.Random(seed)
    done: list[list[str]] = []

    async def stream(index: int, count: int) -> None:
        sid = f"{writer}-s{index}"
        version = 0
        for _ in range(count):
            batch = [
                new_event(sid, version + i, writer) for i in range(1, rng.randint(1, max_batch) + 1)
            ]
            version = await store.append(sid, version, batch)
            done.append([e.event_id for e in batch])
            await asyncio.sleep(rng.uniform(0, 0.004))

    try:
        per_stream = [
            appends // streams + (1 if i < appends % streams else 0) for i in range(streams)
        ]
        await asyncio.gather(*(stream(i, n) for i, n in enumerate(per_stream)))
    finally:
        await store.close()
        await engine.dispose()
    return done


def append_worker(
    url: str,
    name: str,
    engines: int,
    streams: int,
    appends: int,
    max_batch: int,
    go: Any,
    queue: Any,
) -> None:
    """OS-process writer: `engines` independent engines (separate connections, concurrent
    transactions), each appending to its own streams."""

    async def body() -> list[list[str]]:
        queue.put(("ready", name, os.getpid()))
        await asyncio.to_thread(_wait, go)
        results = await asyncio.gather(
            *(
                append_batches(
                    url,
                    f"{name}e{e}",
                    streams=streams,
                    appends=appends,
                    max_batch=max_batch,
                    seed=hash((name, e)),
                )
                for e in range(engines)
            )
        )
        return [ids for result in results for ids in result]

    _report(queue, name, body())


# ------------------------------------------------------------- conflicting ledgers
async def _private_session(
    ledger: Any, sid: str, uid: str, index: int, outcome: str, writer: int
) -> str:
    from sessions import SandboxError

    handle = await ledger.create_session(
        sid,
        uid=uid,
        session_index=index,
        group_size=4,
        partition="train" if index % 2 else "val",
        global_step=1,
        data_source="conflicts",
        metadata={"writer": writer},
    )
    if outcome == "cancel":
        await handle.cancel(f"writer {writer}")
        return "cancelled"
    if outcome == "empty":
        return await handle.complete()  # failed, empty_output
    await handle.record_trajectory(
        prompt_ids=PROMPT, response_ids=list(range(100, 164)), num_turns=2
    )
    await asyncio.sleep(0)
    if outcome == "fail":
        await handle.fail_with(SandboxError(f"writer {writer}: sandbox died"))
        return "failed"
    await handle.post_reward(float(index % 2), writer=writer)
    return await handle.complete()


async def _contend(
    ledger: Any, sid: str, handle: Any, action: str, writer: int, appended: list[Any]
) -> None:
    """Run `action` on a handle loaded at a (soon) stale version; the first append may conflict."""
    if action == "succeed":
        await handle.record_trajectory(
            prompt_ids=PROMPT, response_ids=[7, 8, 9], extra={"writer": writer}
        )
        appended.append((sid, "record_trajectory", handle.version))
        await handle.post_reward(1.0, writer=writer)
        appended.append((sid, "post_reward", handle.version))
        await handle.complete()
        appended.append((sid, "complete", handle.version))
    elif action == "fail":
        await handle.fail("sandbox_error", message=f"writer {writer}", error_type="SandboxError")
        appended.append((sid, "fail", handle.version))
    else:
        await handle.cancel(f"writer {writer}")
        appended.append((sid, "cancel", handle.version))


CONTEND_ACTIONS = ("succeed", "fail", "cancel")


def conflict_worker(
    url: str, writer: int, private: int, shared: int, barrier: Any, queue: Any
) -> None:
    """One OS process with its own `Ledger`: private sessions, plus contention with the other
    writers on the shared session ids `dup-<j>`.

    Phase 1: private sessions and (all writers at once) creation of every shared id: one writer
    wins each, the others must get `InvalidInput`.
    Phase 2: every writer loads every shared session (all at version 2), waits for the others,
    then appends its own action: one wins each session, the others must get `ConcurrencyError`.
    Returns what it created and appended, and every conflict it was told about.
    """
    name = f"w{writer}"

    async def body() -> dict[str, Any]:
        from sessions import ConcurrencyError, InvalidInput, Ledger

        conflicts: list[tuple[str, str, str, int, int]] = []
        created: list[str] = []
        appended: list[tuple[str, str, int]] = []
        private_outcomes: dict[str, str] = {}
        rng = random.Random(writer)
        async with Ledger.open(url, migrate=False, run="conflicts") as ledger:
            queue.put(("ready", name, os.getpid()))
            await asyncio.to_thread(barrier.wait, 60)

            async def private_one(i: int) -> None:
                sid = f"priv-w{writer}-{i}"
                outcome = rng.choice(("ok", "ok", "ok", "fail", "cancel", "empty"))
                private_outcomes[sid] = await _private_session(
                    ledger, sid, f"w{writer}g{i // 4}", i % 4, outcome, writer
                )

            async def create_one(j: int) -> None:
                sid = f"dup-{j}"
                try:
                    await ledger.create_session(
                        sid,
                        uid=f"dupg{j // 4}",
                        session_index=j % 4,
                        group_size=4,
                        partition="val",
                        global_step=2,
                        data_source="conflicts",
                        metadata={"writer": writer},
                    )
                except InvalidInput as error:
                    conflicts.append(("create", sid, type(error).__name__, 0, -1))
                else:
                    created.append(sid)

            order = list(range(shared))
            rng.shuffle(order)
            await asyncio.gather(
                *(private_one(i) for i in range(private)), *(create_one(j) for j in order)
            )

            await asyncio.to_thread(barrier.wait, 60)  # every shared session exists
            handles = {f"dup-{j}": await ledger.load_session(f"dup-{j}") for j in range(shared)}
            await asyncio.to_thread(barrier.wait, 60)  # every writer holds version 2 of each

            async def contend(j: int) -> None:
                sid = f"dup-{j}"
                action = CONTEND_ACTIONS[(writer + j) % len(CONTEND_ACTIONS)]
                try:
                    await _contend(ledger, sid, handles[sid], action, writer, appended)
                except ConcurrencyError as error:
                    conflicts.append(
                        ("stale", sid, type(error).__name__, error.expected, error.actual)
                    )

            rng.shuffle(order)
            await asyncio.gather(*(contend(j) for j in order))
        return {
            "created": created,
            "appended": appended,
            "conflicts": conflicts,
            "private": private_outcomes,
        }

    _report(queue, name, body())


# ------------------------------------------------------------- writers + projectors
async def write_sessions(
    ledger: Any, prefix: str, sessions: int, *, seed: int, pace: float, concurrency: int = 8
) -> dict[str, str]:
    """`sessions` sessions in groups of 4 (some fail, some are cancelled, some fail empty), paced."""
    from sessions import SandboxError

    rng = random.Random(seed)
    outcomes: dict[str, str] = {}
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, plan: str, delay: float) -> None:
        sid = f"{prefix}-{i}"
        async with limit:
            handle = await ledger.create_session(
                sid,
                uid=f"{prefix}g{i // 4}",
                session_index=i % 4,
                group_size=4,
                partition="val" if (i // 4) % 3 == 0 else "train",
                global_step=i // 40,
                data_source="stream",
            )
            await asyncio.sleep(delay)
            if plan == "cancel":
                await handle.cancel("stopped")
            elif plan == "empty":
                await handle.complete()
            else:
                response = [(i * 7 + t) % 30_000 + 1 for t in range(rng.randint(8, 96))]
                await handle.record_trajectory(
                    prompt_ids=PROMPT, response_ids=response, num_turns=1
                )
                if plan == "fail":
                    await handle.fail_with(SandboxError("sandbox lost"))
                else:
                    await handle.post_reward(float(rng.random() < 0.5), acc=1.0)
                    await handle.complete()
            outcomes[sid] = handle.state

    plans = [
        rng.choice(("ok", "ok", "ok", "ok", "fail", "cancel", "empty")) for _ in range(sessions)
    ]
    tasks = []
    for i, plan in enumerate(plans):
        tasks.append(asyncio.ensure_future(one(i, plan, rng.uniform(0, 2 * pace))))
        await asyncio.sleep(pace)
    await asyncio.gather(*tasks)
    return outcomes


def session_writer_worker(
    url: str, name: str, sessions: int, pace: float, go: Any, queue: Any
) -> None:
    async def body() -> dict[str, str]:
        from sessions import Ledger

        async with Ledger.open(url, migrate=False, run="stream") as ledger:
            queue.put(("ready", name, os.getpid()))
            await asyncio.to_thread(_wait, go)
            return await write_sessions(ledger, name, sessions, seed=sum(map(ord, name)), pace=pace)

    _report(queue, name, body())


def follower_worker(
    url: str, name: str, log_path: str, page_size: int, poll: float, queue: Any
) -> None:
    """`Projector(engine).follow(stop, on_leader=...)` until SIGTERM.

    Writes one line per happening to `log_path` (unbuffered, so a SIGKILL loses nothing
    already written): `leader <t>`, `page <events> <last_position> <t>`, `exit <total> <t>`.
    """

    async def body() -> int:
        from sessions.projection.projector import Projector
        from store import create_engine

        log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        engine = create_engine(url)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            projector = Projector(engine, page_size=page_size)
            queue.put(("ready", name, os.getpid()))
            total = await projector.follow(
                stop,
                poll_interval=poll,
                on_leader=lambda: log.write(f"leader {time.time()}\n"),
                on_page=lambda r: log.write(f"page {r.events} {r.last_position} {time.time()}\n"),
            )
            log.write(f"exit {total} {time.time()}\n")
            return total
        finally:
            log.close()
            await engine.dispose()

    _report(queue, name, body())
