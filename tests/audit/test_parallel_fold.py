"""Property: a log folded by step in worker processes and merged (`sessions.audit.parallel_fold`)
gives exactly the read models one process's `Rebuild` gives: every row, every column, in the same
order, queue ids included, at the audit's checkpoint and at the log's end.

Logs come from the replay-equivalence generator (several runs, both partitions, steps and no
step, launches, every outcome, interleaved streams), several concatenated so the steps outnumber
the workers, fed in random pages. The database paths (replay and audit with `workers`, on both
backends) are covered by tests/audit/test_replay_equivalence.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions.audit.fold_merge import merge
from sessions.audit.parallel_fold import ParallelFold, workers_for
from sessions.errors import InvalidArgument, ProjectionError
from sessions.projection.rebuild import ReadModels, Rebuild
from store.log.records import NewEvent
from tests.audit.test_replay_equivalence import random_log

Rows = list[tuple[Any, ...]]


def log_rows(rnd: random.Random, logs: int) -> Rows:
    """`EVENT_COLUMNS` tuples of `logs` generated logs, one after the other, as a reader gives them."""
    events: list[NewEvent] = []
    for _ in range(logs):
        events.extend(random_log(rnd).interleaved())
    return [
        (
            position,
            e.session_id,
            e.version,
            e.type,
            e.schema_version,
            e.data_json,
            str(e.recorded_at),
        )
        for position, e in enumerate(events, start=1)
    ]


def pages(rows: Rows, size: int) -> list[Rows]:
    return [rows[at : at + size] for at in range(0, len(rows), size)]


def one_process(rows: Rows, size: int, through: int | None) -> tuple[ReadModels | None, ReadModels]:
    """What the audit's fold does in one process: the read models at `through` (when the log goes
    past it), then at the end."""
    rebuilt, early = Rebuild(), None
    for page in pages(rows, size):
        if through is not None and early is None and page[-1][0] > through:
            upto = [row for row in page if row[0] <= through]
            rebuilt.feed(upto)
            early = rebuilt.snapshot()
            rebuilt.feed(page[len(upto) :])
        else:
            rebuilt.feed(page)
    return early, rebuilt.result()


async def apart(
    rows: Rows, size: int, workers: int, through: int | None
) -> tuple[ReadModels | None, ReadModels | None, int]:
    folded = 0

    def count(n: int) -> None:
        nonlocal folded
        folded += n

    async with ParallelFold(workers, through=through, on_folded=count) as fold:
        for page in pages(rows, size):
            fold.feed(page)
        early, whole = await fold.result()
    return early, whole, folded


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    logs=st.integers(1, 4),
    workers=st.integers(2, 3),
    size=st.sampled_from([1, 7, 50, 10_000]),
    cut=st.sampled_from([None, 0.0, 0.3, 0.7, 1.0]),
)
def test_a_parallel_fold_equals_one_process(
    seed: int, logs: int, workers: int, size: int, cut: float | None
) -> None:
    rows = log_rows(random.Random(seed), logs)
    through = None if cut is None else int(len(rows) * cut)
    want_early, want = one_process(rows, size, through)
    early, whole, folded = asyncio.run(apart(rows, size, workers, through))
    assert folded == len(rows), "progress counts every event once, as it is folded"
    assert whole is not None, "a generated log keeps each step in one worker"
    if want_early is None:
        assert early is None
        assert whole == want
    else:
        assert early == want_early
        assert whole.errors == want.errors  # all the audit reads of the whole log then


def test_a_step_split_between_workers_is_refused_so_the_caller_folds_in_one_process() -> None:
    """A session whose first creation is unreadable is routed before its step is known; its valid
    creation then lands in a step another worker owns, and the merge must not guess."""
    created = {
        "run": "r",
        "uid": "u",
        "session_index": 0,
        "group_size": 2,
        "partition": "train",
        "global_step": 0,
        "data_source": None,
        "runner": None,
        "sample_index": None,
        "metadata": {},
        "launch": None,
    }

    def row(position: int, sid: str, version: int, type_: str, data: Any) -> tuple[Any, ...]:
        text = data if isinstance(data, str) else json.dumps(data)
        return (position, sid, version, type_, 2 if type_ == "SessionCreated" else 1, text, "t")

    rows = [
        row(1, "a", 1, "SessionCreated", created),  # step 0 -> worker 0
        row(2, "a", 2, "SessionStarted", {"attempt": 1, "timeout_s": None}),
        row(3, "b", 1, "SessionCreated", {**created, "global_step": 1}),  # step 1 -> worker 1
        row(4, "c", 1, "SessionCreated", "{"),  # unreadable: least loaded, worker 1
        row(5, "c", 2, "SessionCreated", {**created, "session_index": 1}),  # step 0, on worker 1
    ]
    early, whole, _ = asyncio.run(apart(rows, 10, 2, None))
    assert (early, whole) == (None, None)


def test_merge_refuses_parts_that_share_a_step() -> None:
    step = {"run": "r", "partition": "train", "global_step": 3}
    session = {**step, "uid": "u", "data_source": None}
    one = ReadModels(sessions=[{**session, "session_id": "a", "created_position": 1}])
    two = ReadModels(sessions=[{**session, "session_id": "b", "created_position": 2}])
    assert merge([one, two], pruned=set(), last_position=2, events=2) is None
    assert merge([one], pruned=set(), last_position=1, events=1) is not None


def test_merge_refuses_a_group_no_session_accounts_for() -> None:
    group = {"run": "r", "partition": "train", "global_step": 3, "uid": "u"}
    assert merge([ReadModels(groups=[group])], pruned=set(), last_position=0, events=0) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_workers_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="workers must be an integer >= 1"):
        asyncio.run(workers_for(None, bad))  # type: ignore[arg-type]


def test_a_parallel_fold_needs_two_workers() -> None:
    with pytest.raises(InvalidArgument, match="2 or more workers"):
        ParallelFold(1)


def test_a_worker_that_fails_is_reported_with_its_traceback() -> None:
    async def main() -> None:
        async with ParallelFold(2) as fold:
            fold.feed([(1, "a", 1, "SessionCreated", 2, "{}", "t", "an extra column")])
            await fold.result()

    with pytest.raises(
        ProjectionError, match=r"(?s)fold worker 0 failed; run with workers=1.*Error"
    ):
        asyncio.run(main())


def test_a_worker_killed_is_reported_not_waited_for() -> None:
    async def main() -> None:
        async with ParallelFold(2) as fold:
            fold._procs[1].kill()
            fold._procs[1].join()
            await fold.result()

    with pytest.raises(ProjectionError, match="fold worker 1 ended with exit code -9"):
        asyncio.run(main())


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI of this checkout (not an installed copy), run as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run(
        [sys.executable, "-m", "sessions.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_replay_and_audit_verbs_take_workers(tmp_path: Path) -> None:
    """`--workers N` folds in N processes and changes nothing the verbs report; 0 is refused
    before any database opens."""
    demo = _cli(
        "demo", "--db", "demo.db", "--steps", "3", "--prompts", "4", "--seed", "3", cwd=tmp_path
    )
    assert demo.returncode == 0, demo.stderr
    for workers in ("1", "2"):
        audited = _cli("audit", "--db", "demo.db", "--workers", workers, cwd=tmp_path)
        assert audited.returncode == 0, audited.stderr
        assert "audit passed" in audited.stdout
        into = f"replayed-{workers}.db"
        replayed = _cli(
            "replay", "--db", "demo.db", "--into", into, "--workers", workers, cwd=tmp_path
        )
        assert replayed.returncode == 0, replayed.stderr
        again = _cli("audit", "--db", into, "--workers", "2", cwd=tmp_path)
        assert again.returncode == 0 and "audit passed" in again.stdout, again.stderr
    refused = _cli("audit", "--db", "nowhere.db", "--workers", "0", cwd=tmp_path)
    assert refused.returncode == 2
    assert "--workers" in refused.stderr and "0" in refused.stderr


class _Log:
    """An engine whose log ends at `end`, for `workers_for` (it asks only that)."""

    def __init__(self, end: int) -> None:
        self.end = end

    def connect(self) -> Any:
        log = self

        class _Conn:
            async def __aenter__(self) -> _Log:
                return log

            async def __aexit__(self, *exc: object) -> None:
                return None

        return _Conn()


@pytest.mark.parametrize(
    ("cores", "end", "expected"),
    [
        (1, 10**6, 1),
        (2, 10**6, 1),  # two cores: the workers' extra CPU costs more wall than they save
        (3, 10**6, 2),
        (16, 10**6, 4),  # at most MAX_WORKERS
        (16, 10, 1),  # a short log: no pool
    ],
)
def test_the_default_folds_apart_only_with_cores_to_spare_and_a_long_log(
    cores: int, end: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sessions.audit.parallel_fold as parallel

    monkeypatch.setattr(parallel, "usable_cores", lambda: cores)
    monkeypatch.setattr(parallel.rm, "log_end", lambda conn: asyncio.sleep(0, conn.end))
    assert asyncio.run(workers_for(_Log(end), None)) == expected  # type: ignore[arg-type]
    assert asyncio.run(workers_for(_Log(end), 2)) == 2  # type: ignore[arg-type]
