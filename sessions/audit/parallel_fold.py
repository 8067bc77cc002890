"""The whole-log fold on every core: a log's steps folded in worker processes, then merged.

Why: a rebuild is Python per event on one thread while the other cores idle. The fold is
independent per step (every read model is one step's, `sessions.audit.fold_merge`), so the
parent routes each session's events to the worker that owns the session's step, decided at its
first `SessionCreated` (a new step goes to the worker with the fewest events so far); every
later event of the session follows it by session id, whatever it holds. Each worker folds its
share with the same `Rebuild` one process uses; the parent keeps the run streams' events (the
prunes) and merges. A log the merge cannot put back together (a step split between workers) is
reported as such, and the caller folds it in one process: the result never depends on routing.

The parent reads the pages and ships them: the audit reads every event once for its own checks
anyway, and a replay's parent only waits for the copy (a worker reading the log itself costs
~0.2 s of CPU per 100k events, shipping it ~0.1 s to pickle and ~0.06 s to unpickle). Workers are
forked where the platform allows it (the modules are loaded already: spawning a worker imports
~0.5 s of them), spawned elsewhere.

By default (`workers_for`) the fold stays in the calling process unless the machine has a core
for the caller and two or more for workers: the workers spend ~1.2 s of CPU per 100k events
(pickling, page faults of forked memory) to take ~0.35 s off the caller, which pays only with idle
cores; on two cores the pair measured 0.7-0.9x of one process (docs/benchmarks.md). Below
`PARALLEL_FROM` events it stays too: a pool would cost more than the fold it shares.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from sessions.audit.fold_merge import merge
from sessions.errors import InvalidArgument, ProjectionError
from sessions.events import RUN_STREAM_EVENTS
from sessions.gc_pause import gc_paused
from sessions.projection.rebuild import ReadModels, Rebuild
from store import AsyncEngine, load_json
from store import read_models as rm

__all__ = [
    "MAX_WORKERS",
    "PARALLEL_CORES",
    "PARALLEL_FROM",
    "ParallelFold",
    "workers_for",
]

#: Logs shorter than this fold in the calling process by default: one process folds ~100k events
#: a second, so a pool (a fork and a merge, ~0.05-0.1 s) would cost more than it shares.
PARALLEL_FROM = 50_000
#: Workers `workers_for` starts at most by default, whatever the core count.
MAX_WORKERS = 4
#: Usable cores from which `workers_for` folds in workers by default: one for the caller, two or
#: more for workers (on fewer, the workers' extra CPU costs more wall time than they save).
PARALLEL_CORES = 3

_CREATED = "SessionCreated"


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


async def workers_for(engine: AsyncEngine, workers: int | None) -> int:
    """The fold's worker count: `workers` if given (1: fold in this process); else, on a machine
    of `PARALLEL_CORES` usable cores or more and a log of `PARALLEL_FROM` events or more, one per
    core but the caller's (at most `MAX_WORKERS`); else 1."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidArgument(
                f"workers must be an integer >= 1 (1 folds in this process), not {workers!r}"
            )
        return workers
    cores = usable_cores()
    if cores < PARALLEL_CORES:
        return 1
    async with engine.connect() as conn:
        end = await rm.log_end(conn)
    return min(cores - 1, MAX_WORKERS) if end >= PARALLEL_FROM else 1


def _context() -> Any:
    """Fork where it is safe and cheap (Linux); spawn elsewhere (macOS forks unsafely)."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    return multiprocessing.get_context(method)


class ParallelFold:
    """Feed pages of `EVENT_COLUMNS` tuples in position order, then `await result()`.

    `through`: also return the read models as of that position (the audit compares those).
    `on_folded(n)` is called as workers report pages folded, so a progress bar counts folded
    events, not events handed over. Use as an async context manager, so workers never outlive it.
    """

    def __init__(
        self,
        workers: int,
        *,
        through: int | None = None,
        on_folded: Callable[[int], None] | None = None,
    ) -> None:
        if workers < 2:
            raise InvalidArgument(f"a parallel fold needs 2 or more workers, not {workers}")
        ctx = _context()
        self._outbox: Any = ctx.Queue()
        self._inboxes: list[Any] = [ctx.Queue() for _ in range(workers)]
        self._procs = [
            ctx.Process(target=_work, args=(index, inbox, self._outbox, through), daemon=True)
            for index, inbox in enumerate(self._inboxes)
        ]
        for proc in self._procs:
            proc.start()
        self._through = through
        self._on_folded = on_folded
        self._runs = Rebuild()  # the run streams' events: the prunes
        self._owner: dict[str, int] = {}
        self._step_owner: dict[Any, int] = {}
        self._load = [0] * workers
        self._results: dict[int, tuple[ReadModels | None, ReadModels]] = {}
        self.events = 0
        self.last_position = 0
        self.sessions = 0
        self._at_through = (0, 0)  # last position and events up to `through`
        self._closed = False

    async def __aenter__(self) -> ParallelFold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    @property
    def pruned(self) -> set[tuple[str, str, int]]:
        return self._runs.pruned

    def feed(self, rows: Sequence[Sequence[Any]]) -> None:
        """Route one page: each session's events to its step's worker, run streams' kept here."""
        if not rows:
            return
        shares: list[list[Sequence[Any]]] = [[] for _ in self._inboxes]
        runs: list[Sequence[Any]] = []
        owner, run_types = self._owner, RUN_STREAM_EVENTS
        for row in rows:
            if row[3] in run_types:
                runs.append(row)
                continue
            worker = owner.get(row[1])
            if worker is None:
                worker = self._place(row, shares)
            shares[worker].append(row)
        for worker, share in enumerate(shares):
            if share:
                self._inboxes[worker].put(share)
                self._load[worker] += len(share)
        if runs:
            self._runs.feed(runs)
            if self._on_folded is not None:
                self._on_folded(len(runs))
        self.events += len(rows)
        self.last_position = rows[-1][0]
        if self._through is not None and rows[0][0] <= self._through:
            upto = sum(1 for row in rows if row[0] <= self._through)
            last = rows[upto - 1][0]
            self._at_through = (last, self._at_through[1] + upto)
        self._drain()

    def _place(self, row: Sequence[Any], shares: list[list[Sequence[Any]]]) -> int:
        """The worker of an event whose session has none yet: its step's for a creation (a new
        step to the least loaded worker); any for another event (it only makes an error row)."""
        if row[3] != _CREATED:
            return 0
        step = _step_of(row[5])
        worker = self._step_owner.get(step)
        if worker is None:
            loads = [done + len(share) for done, share in zip(self._load, shares)]
            worker = self._step_owner[step] = loads.index(min(loads))
        self._owner[row[1]] = worker
        self.sessions += 1
        return worker

    def _drain(self, *, wait: float | None = None) -> bool:
        """Take the workers' messages waiting (or the first within `wait` seconds): progress and
        results. Returns whether one was taken."""
        taken = False
        while True:
            try:
                if wait is None:
                    message = self._outbox.get(block=False)
                else:
                    message = self._outbox.get(timeout=wait)
            except queue.Empty:
                return taken
            taken = True
            kind, worker, body = message
            if kind == "folded":
                if self._on_folded is not None:
                    self._on_folded(body)
            elif kind == "done":
                self._results[worker] = body
            else:
                self.close()
                raise ProjectionError(
                    f"fold worker {worker} failed; run with workers=1 (the CLI's --workers 1) to "
                    f"fold in one process. The worker's error:\n{body}"
                )
            if wait is not None:
                return taken

    def _lost(self) -> None:
        """Raise if a worker ended without its result (killed, or out of memory)."""
        self._drain()
        for index, proc in enumerate(self._procs):
            if index not in self._results and proc.exitcode is not None:
                self.close()
                raise ProjectionError(
                    f"fold worker {index} ended with exit code {proc.exitcode} before its result "
                    "(killed, or out of memory?); run with workers=1 (the CLI's --workers 1) to "
                    "fold in one process"
                )

    async def result(self) -> tuple[ReadModels | None, ReadModels | None]:
        """The merged read models as of `through` (None without one, or when the log does not
        reach past it) and of the whole log (of which, when the first is given, only the
        quarantined events: that is all the audit reads of it); (None, None) when the steps could
        not be kept apart (fold the log in one process then)."""
        for inbox in self._inboxes:
            inbox.put(None)
        while len(self._results) < len(self._procs):
            if not await asyncio.to_thread(self._drain, wait=0.5):
                self._lost()
        self.close()
        parts = [self._results[index] for index in range(len(self._procs))]
        pruned = self._runs.pruned
        with gc_paused():
            whole = merge(
                [w for _s, w in parts],
                pruned=pruned,
                last_position=self.last_position,
                events=self.events,
            )
            if whole is None:
                return None, None
            if all(s is None for s, _w in parts):
                return None, whole
            last, count = self._at_through
            early = merge(
                [s if s is not None else w for s, w in parts],
                pruned=pruned,
                last_position=last,
                events=count,
            )
        return early, whole

    def close(self) -> None:
        """Stop every worker that has not sent its result (an error or a cancellation left it)."""
        if self._closed:
            return
        self._closed = True
        for index, proc in enumerate(self._procs):
            if index not in self._results and proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join()
        for channel in (*self._inboxes, self._outbox):
            channel.cancel_join_thread()
            channel.close()


def _step_of(raw: Any) -> Any:
    """A creation's (run, partition, global_step), as the rules will read it; None if unreadable
    (such a creation makes no session, or the merge finds the step split)."""
    try:
        data = raw if type(raw) is dict else load_json(raw)
        step = (data["run"], data["partition"], data["global_step"])
        hash(step)
    except Exception:  # noqa: BLE001 - any unreadable data: the rules quarantine it
        return None
    return step


def _work(index: int, inbox: Any, outbox: Any, through: int | None) -> None:
    """A worker: fold the pages it is sent until None, then send its read models back."""
    import gc

    gc.disable()  # only long-lived, acyclic rows are made here (sessions.gc_pause)
    try:
        rebuilt, early = Rebuild(), None
        while True:
            rows = inbox.get()
            if rows is None:
                break
            if through is not None and early is None and rows[-1][0] > through:
                upto = [row for row in rows if row[0] <= through]
                rebuilt.feed(upto)
                early = rebuilt.snapshot()
                rebuilt.feed(rows[len(upto) :])
            else:
                rebuilt.feed(rows)
            outbox.put(("folded", index, len(rows)))
        whole = rebuilt.result()
        if early is not None:  # only the quarantined events are read of the whole log then
            whole = ReadModels(errors=whole.errors, last_position=whole.last_position)
        outbox.put(("done", index, (early, whole)))
    except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
        outbox.put(("failed", index, traceback.format_exc()))
