"""An interrupted replay never leaves a target that looks complete (docs/design.md §9).

Replay copies the log and writes its read models in one transaction on the target. Whatever
stops it — the fold failing, the process killed between the copy and the commit — the target
has no events, no read models and no checkpoint, and a second replay into it succeeds.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import func, select

from sessions.audit import replay as replay_module
from sessions.audit.auditing import compare
from sessions.audit.replay import replay
from sessions.projection.projector import Projector
from store import create_engine
from store.schema.migrate import upgrade
from store.schema.tables import checkpoints, events, queue_rows, sessions
from tests import REPO, golden
from tests.conftest import BACKENDS, fresh_database

LOG = golden.golden_logs()[-1]


async def _projected_source(url: str) -> None:
    engine = create_engine(url)
    try:
        await golden.load_golden(engine, LOG)
        await Projector(engine).run()
    finally:
        await engine.dispose()


async def _counts(url: str) -> tuple[int, int, int, int]:
    """Events, sessions, queue rows and checkpoints in the database at `url`."""
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return tuple(
                [  # type: ignore[return-value]
                    (await conn.execute(select(func.count()).select_from(table))).scalar_one()
                    for table in (events, sessions, queue_rows, checkpoints)
                ]
            )
    finally:
        await engine.dispose()


async def _replay(source_url: str, target_url: str) -> int:
    source, target = create_engine(source_url), create_engine(target_url)
    try:
        await upgrade(target)
        return (await replay(source, target)).events
    finally:
        await source.dispose()
        await target.dispose()


async def _assert_equal(source_url: str, target_url: str) -> None:
    source, target = create_engine(source_url), create_engine(target_url)
    try:
        assert await compare(target, source) == []
    finally:
        await source.dispose()
        await target.dispose()


class _FoldFailed(Exception):
    pass


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_failed_fold_leaves_the_target_empty_and_replayable(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        fresh_database(backend, name="source") as source_url,
        fresh_database(backend, name="target") as target_url,
    ):
        await _projected_source(source_url)
        real_prepare = replay_module.prepare

        def failing_prepare(*args: object, **kwargs: object) -> object:
            raise _FoldFailed("the fold stops after the copy started")

        monkeypatch.setattr(replay_module, "prepare", failing_prepare)
        with pytest.raises(_FoldFailed):
            await _replay(source_url, target_url)
        assert await _counts(target_url) == (0, 0, 0, 0)
        monkeypatch.setattr(replay_module, "prepare", real_prepare)
        replayed = await _replay(source_url, target_url)
        assert replayed == len(golden.read_rows(LOG))
        assert (await _counts(target_url))[0] == replayed
        await _assert_equal(source_url, target_url)


_KILLED = textwrap.dedent("""
    import asyncio, os, sys
    from sessions.audit.replay import replay
    from store import bulk_read_models, create_engine
    from store.schema.migrate import upgrade

    real = bulk_read_models.write_read_models

    async def write_then_die(write, rows, target, **options):
        await real(write, rows, target, **options)  # log and read models written, not committed
        os._exit(17)

    bulk_read_models.write_read_models = write_then_die

    async def main():
        source, target = create_engine(sys.argv[1]), create_engine(sys.argv[2])
        await upgrade(target)
        await replay(source, target)

    asyncio.run(main())
""")


def test_a_replay_killed_before_its_commit_leaves_the_target_empty(tmp_path: Path) -> None:
    """The process dies inside the transaction: on the next open, SQLite rolls the hot journal
    back, and the target holds nothing of the replay."""
    source_url = f"sqlite+aiosqlite:///{tmp_path / 'source.db'}"
    target_url = f"sqlite+aiosqlite:///{tmp_path / 'target.db'}"
    asyncio.run(_projected_source(source_url))
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED, source_url, target_url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert killed.returncode == 17, killed.stderr
    assert asyncio.run(_counts(target_url)) == (0, 0, 0, 0)
    assert asyncio.run(_replay(source_url, target_url)) == len(golden.read_rows(LOG))
    asyncio.run(_assert_equal(source_url, target_url))


async def test_queue_rows_written_while_the_fold_goes_on_replay_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replay writes the queue rows the fold has made while it goes on (the copy done first):
    those rows, then the rest with the other read models, equal a replay written at the end.
    Only a fold in this process makes them as it goes (workers' rows come at their end)."""
    source_url = f"sqlite+aiosqlite:///{tmp_path / 'source.db'}"
    await _projected_source(source_url)
    early: list[int] = []
    real_write = replay_module.bulk.write_queue_rows

    async def counted(write: object, rows: list[tuple[object, ...]]) -> None:
        early.append(len(rows))
        await real_write(write, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(replay_module, "EARLY_QUEUE_ROWS", 1)
    monkeypatch.setattr(replay_module.bulk, "write_queue_rows", counted)
    source, target = (
        create_engine(source_url),
        create_engine(f"sqlite+aiosqlite:///{tmp_path / 'target.db'}"),
    )
    try:
        await upgrade(target)
        report = await replay(
            source, target, page_size=1, workers=1
        )  # a page per event: the fold outlasts the copy
    finally:
        await source.dispose()
        await target.dispose()
    assert report.events == len(golden.read_rows(LOG))
    assert len(early) >= 2, (
        "no queue row was written before the fold ended (the last call is write_read_models')"
    )
    assert sum(early) == (await _counts(f"sqlite+aiosqlite:///{tmp_path / 'target.db'}"))[2]
    await _assert_equal(source_url, f"sqlite+aiosqlite:///{tmp_path / 'target.db'}")
