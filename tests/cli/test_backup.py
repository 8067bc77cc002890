"""Backups: an online SQLite backup taken while a writer appends, restored and audited;
PostgreSQL through pg_dump / pg_restore into a fresh database, audited (docs/operations.md)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sessions import Ledger
from sessions.audit.auditing import audit
from sessions.cli.main import main
from store import backup, create_engine
from tests.conftest import IN_CI, _pg_dsn, fresh_database

_SLICE_PAGES = 8  # small slices, so appends land between them


async def _writer(ledger: Ledger, stop: threading.Event, acked: list[str]) -> None:
    """Record failed sessions until `stop`; a session id joins `acked` once its last append
    committed."""
    number = 0
    while not stop.is_set():
        sid = f"s{number}"
        handle = await ledger.create_session(
            sid, uid=f"u{number}", session_index=0, group_size=1, partition="train", global_step=0
        )
        await handle.fail("runner_error", message="x" * 2000)
        acked.append(sid)
        number += 1
        await asyncio.sleep(0)


def _events(path: Path) -> list[tuple[int, str, str]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT position, session_id, event_id FROM events ORDER BY position"
        ).fetchall()


async def test_sqlite_online_backup_while_writing(tmp_path: Path) -> None:
    source = tmp_path / "live.db"
    copy = tmp_path / "copy.db"
    acked: list[str] = []
    stop = threading.Event()
    async with Ledger.open(str(source), run="r") as ledger:
        writer = asyncio.create_task(_writer(ledger, stop, acked))
        while len(acked) < 50:  # a file of some pages before the copy starts
            await asyncio.sleep(0.01)
        acked_before = list(acked)
        report = await asyncio.to_thread(
            backup.backup_sqlite, source, copy, pages=_SLICE_PAGES, pause=0.01
        )
        acked_during = len(acked) - len(acked_before)
        stop.set()
        await writer
        await ledger.project()
    assert report.slices > 1, report
    assert acked_during > 0, "the writer was stalled for the whole backup"
    copied = _events(copy)
    assert copied == _events(source)[: len(copied)], "the copy is not a prefix of the log"
    sessions = {row[1] for row in copied}
    missing = [sid for sid in acked_before if sid not in sessions]
    assert not missing, f"acknowledged before the backup, missing from it: {missing[:5]}"
    engine = create_engine(str(copy), require_ledger=True)
    try:
        result = await audit(engine)
    finally:
        await engine.dispose()
    assert result.ok, result.divergences[:3]
    assert result.events == len(copied)


def test_cli_backup_refuses_ledgers_and_postgres(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    db = tmp_path / "ledger.db"
    assert (
        main(["demo", "--db", str(db), "--steps", "1", "--prompts", "2", "--group-size", "2"]) == 0
    )
    out = tmp_path / "copy.db"
    assert main(["backup", "--db", str(db), "--out", str(out)]) == 0
    assert main(["audit", "--db", str(out)]) == 0
    capsys.readouterr()
    for target in (out, db, Path(f"{db}-wal")):  # a ledger, the ledger itself, its WAL
        assert main(["backup", "--db", str(db), "--out", str(target), "--force"]) == 1
        assert "ledger" in capsys.readouterr().err
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    assert main(["backup", "--db", str(db), "--out", str(other)]) == 1
    assert "--force" in capsys.readouterr().err
    assert other.read_text() == "mine"
    assert main(["backup", "--db", str(db), "--out", str(other), "--force"]) == 0
    assert main(["backup", "--db", "postgresql://u@localhost/x", "--out", str(tmp_path / "p")]) == 1
    assert "pg_dump" in capsys.readouterr().err


def test_postgres_dump_restore_audit(tmp_path: Path) -> None:
    tools = [shutil.which("pg_dump"), shutil.which("pg_restore")]
    if None in tools:
        message = "pg_dump / pg_restore not on PATH: the PostgreSQL backup way is untested here"
        if IN_CI:
            pytest.fail(message + " — CI must install the PostgreSQL client tools")
        pytest.skip(message)
    with fresh_database("postgres") as source, fresh_database("postgres") as target:
        assert main(["demo", "--db", source, "--steps", "2", "--prompts", "2", "--run", "r"]) == 0
        dump = tmp_path / "ledger.dump"
        env = {**os.environ, "PGCONNECT_TIMEOUT": "10"}
        subprocess.run(
            ["pg_dump", "-Fc", "-f", str(dump), _pg_dsn(_database(source))],
            check=True,
            env=env,
            timeout=120,
        )
        subprocess.run(
            ["pg_restore", "--no-owner", "-d", _pg_dsn(_database(target)), str(dump)],
            check=True,
            env=env,
            timeout=120,
        )
        assert main(["audit", "--db", target]) == 0
        assert main(["sql", "SELECT count(*) FROM events", "--db", target]) == 0


def _database(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).database


#: A writer of a partial backup killed mid-transaction: what SIGKILL leaves is the partial file and
#: its rollback journal (the pid in the name is then dead).
_KILLED_WRITER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("CREATE TABLE t (x)")
conn.execute("BEGIN")
conn.execute("INSERT INTO t VALUES (zeroblob(100000))")
conn.execute("CREATE TABLE u (y)")
print("writing", flush=True)
sys.stdin.read()
"""


def _killed_backup_leftovers(folder: Path, out: Path) -> list[Path]:
    """A real partial backup of `out` whose writer was SIGKILLed mid-write: `.OUT.PID.HEX.part`
    and its `-journal`, named by the dead writer's pid."""
    partial = folder / "writing.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(partial)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
    writer.kill()  # SIGKILL: no cleanup runs
    writer.wait()
    dead = folder / f".{out.name}.{writer.pid}.0123abcd.part"
    partial.rename(dead)
    Path(f"{partial}-journal").rename(f"{dead}-journal")
    left = sorted(p for p in folder.iterdir() if p.name.startswith(f".{out.name}."))
    assert [p.name.rsplit(".", 1)[1] for p in left] == ["part", "part-journal"], left
    return left


def test_backup_removes_what_a_killed_backup_left(tmp_path: Path) -> None:
    """A SIGKILLed `backup` leaves `.OUT.PID.HEX.part` and `.part-journal`; the next run removes
    both (a live writer's, whose pid is alive, are left alone)."""
    db = tmp_path / "ledger.db"
    assert (
        main(["demo", "--db", str(db), "--steps", "1", "--prompts", "1", "--group-size", "1"]) == 0
    )
    out = tmp_path / "copy.db"
    left = _killed_backup_leftovers(tmp_path, out)
    alive = tmp_path / f".{out.name}.{os.getppid()}.feedbeef.part-journal"
    alive.write_bytes(b"a live writer's")
    assert main(["backup", "--db", str(db), "--out", str(out)]) == 0
    assert not any(p.exists() for p in left), left
    assert alive.exists()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        ["ledger.db", "ledger.db-shm", "ledger.db-wal", "copy.db", alive.name]
    ), names


def test_backup_into_a_missing_folder_blames_out(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    db = tmp_path / "ledger.db"
    assert (
        main(["demo", "--db", str(db), "--steps", "1", "--prompts", "1", "--group-size", "1"]) == 0
    )
    capsys.readouterr()
    out = tmp_path / "no-such-folder" / "copy.db"
    assert main(["backup", "--db", str(db), "--out", str(out)]) == 1
    line = capsys.readouterr().err.strip()
    assert "--out" in line and "no-such-folder" in line and "does not exist" in line, line
    assert "--db" not in line, line
    assert main(["backup", "--db", str(db), "--out", str(tmp_path)]) == 1
    assert "is a directory" in capsys.readouterr().err
