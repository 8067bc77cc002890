"""`rollout-ledger` fails in one line (docs/design.md §11): whatever goes wrong, stderr holds exactly one
`rollout-ledger: error: <reason>` line naming what was wrong, the exit status is non-zero, and no
traceback reaches the user unless `--debug` asks for it.

Run as a user runs it, in a subprocess (`python -m sessions.cli`), against a damaged log or
database, files SQLite cannot read, PostgreSQL servers that do not answer or lack the database, a missing
optional driver and Ctrl-C; the mapping itself (`sessions.cli.errors.reason`) is checked in
process for what a subprocess cannot easily provoke (a full disk, a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from sessions import Ledger
from sessions.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, reason
from store import create_engine
from store.schema.tables import events
from tests.conftest import default_sigint

PREFIX = "rollout-ledger: error: "
KW = {"uid": "u1", "session_index": 0, "group_size": 1, "partition": "val", "global_step": 0}


def cli(
    *args: str, cwd: Path, prelude: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`rollout-ledger ARGS` in a fresh interpreter; `prelude` runs first (e.g. to hide a module)."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    env["COLUMNS"] = "200"
    if prelude is None:
        command = [sys.executable, "-m", "sessions.cli", *args]
    else:
        command = [
            sys.executable,
            "-c",
            f"{prelude}\nimport sys\nfrom sessions.cli import main\nraise SystemExit(main(sys.argv[1:]))",
            *args,
        ]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def one_line(result: subprocess.CompletedProcess[str], status: int = EXIT_ERROR) -> str:
    """The single error line of a failed run (asserting there is exactly one, and no traceback)."""
    shown = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == status, shown
    assert "Traceback" not in result.stderr, shown
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), shown
    return lines[0][len(PREFIX) :]


# -- a damaged log, a damaged database -------------------------------------------------------


async def _record(path: Path, damage: str) -> None:
    """One finished session, then `damage` done straight to the database, past the store's checks."""
    async with Ledger.open(str(path)) as ledger:
        handle = await ledger.create_session("ok-s0", **KW)
        await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4])
        await handle.complete()
        await ledger.project()
    engine = create_engine(str(path))
    try:
        async with engine.begin() as conn:
            if damage == "dropped-table":
                await conn.exec_driver_sql("DROP TABLE events")
                return
            stream = [
                dict(row._mapping)
                for row in await conn.execute(
                    select(events).where(events.c.session_id == "ok-s0").order_by(events.c.position)
                )
            ]
            if (
                damage == "no-created"
            ):  # the session's stream again, under a new id, minus its SessionCreated
                rows = [{**row, "session_id": "ghost-s0"} for row in stream[1:]]
            elif (
                damage == "unknown-type"
            ):  # a new session whose one event is of a type never heard of
                rows = [
                    {
                        **stream[0],
                        "session_id": "odd-s0",
                        "uid": "u-odd",
                        "type": "SessionTeleported",
                        "data": {"where": "mars"},
                    }
                ]
            else:  # a new session, its SessionCreated to be broken below
                rows = [{**stream[0], "session_id": "odd-s0", "uid": "u-odd"}]
            for row in rows:
                row.pop("position")
                row["event_id"] = str(uuid.uuid4())
            await conn.execute(events.insert(), rows)
            if damage == "malformed-json":  # SQLite keeps JSON as text: a hand edit can break it
                await conn.exec_driver_sql(
                    "UPDATE events SET data = '{not json' WHERE session_id = 'odd-s0'"
                )
    finally:
        await engine.dispose()


#: kind -> what the line must name if the verb fails. The projector quarantines an event it
#: cannot project (docs/design.md §7), so a verb may also succeed on these; it must never show a traceback.
DAMAGED_LOGS = {
    "no-created": ("ghost-s0",),
    "unknown-type": ("SessionTeleported",),
    "malformed-json": ("malformed", "{not json"),
}
#: kind -> what the line must name; every verb fails on these.
DAMAGED_DATABASES = {
    "dropped-table": ("no such table", "events", "restore it from a backup"),
}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("damaged")
    made = {kind: folder / f"{kind}.db" for kind in {**DAMAGED_LOGS, **DAMAGED_DATABASES}}
    for kind, path in made.items():
        asyncio.run(_record(path, kind))
    return made


def _copy(db: Path, folder: Path) -> Path:
    """A private copy (with any WAL beside it), so no test sees another's writes."""
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{db}{suffix}")
        if source.exists():
            shutil.copyfile(source, folder / f"{db.name}{suffix}")
    return folder / db.name


DAMAGED_VERBS = {
    "project": ["project"],
    "metrics": ["metrics"],
    "export": ["export", "--partition", "val", "--step", "0", "--out", "batch.pt"],
    "recover": ["recover", "--older-than", "0s"],
    "replay": ["replay", "--into", "replayed.db"],
}


@pytest.mark.parametrize("kind", DAMAGED_DATABASES)
@pytest.mark.parametrize("verb", DAMAGED_VERBS)
def test_a_damaged_database_fails_in_one_line(
    damaged: dict[str, Path], kind: str, verb: str, tmp_path: Path
) -> None:
    db = _copy(damaged[kind], tmp_path)
    line = one_line(cli(*DAMAGED_VERBS[verb], "--db", str(db), cwd=tmp_path))
    for text in DAMAGED_DATABASES[kind]:
        assert text in line, line
    assert not (tmp_path / "batch.pt").exists()


@pytest.mark.parametrize("kind", DAMAGED_LOGS)
@pytest.mark.parametrize("verb", DAMAGED_VERBS)
def test_a_damaged_log_never_shows_a_traceback(
    damaged: dict[str, Path], kind: str, verb: str, tmp_path: Path
) -> None:
    db = _copy(damaged[kind], tmp_path)
    result = cli(*DAMAGED_VERBS[verb], "--db", str(db), cwd=tmp_path)
    if result.returncode == 0:
        assert "Traceback" not in result.stderr and result.stderr.strip() == "", result.stderr
        return
    line = one_line(result)
    for text in DAMAGED_LOGS[kind]:
        assert text in line, line


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(damaged: dict[str, Path], where: str, tmp_path: Path) -> None:
    db = str(_copy(damaged["dropped-table"], tmp_path))
    args = (
        ["--debug", "project", "--db", db]
        if where == "before"
        else ["project", "--db", db, "--debug"]
    )
    result = cli(*args, cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr, result.stderr
    assert "OperationalError" in result.stderr and "no such table: events" in result.stderr, (
        result.stderr
    )
    assert PREFIX not in result.stderr  # the traceback instead of the one line, not beside it


# -- files SQLite cannot read ------------------------------------------------------------------


def _directory(folder: Path, _good: Path) -> Path:
    (folder / "a-folder").mkdir()
    return folder / "a-folder"


def _random_bytes(folder: Path, _good: Path) -> Path:
    (folder / "noise.db").write_bytes(random.Random(0).randbytes(16 * 1024))
    return folder / "noise.db"


def _truncated(folder: Path, good: Path) -> Path:
    data = _copy(good, folder).read_bytes()
    (folder / "cut.db").write_bytes(data[: len(data) // 2])
    return folder / "cut.db"


def _under_a_file(folder: Path, _good: Path) -> Path:
    (folder / "plain.txt").write_text("not a folder\n")
    return folder / "plain.txt" / "ledger.db"


def _no_permission(folder: Path, good: Path) -> Path:
    db = _copy(good, folder)
    db.chmod(0)
    if os.access(db, os.R_OK):
        pytest.skip("this user reads a mode-000 file anyway (root)")
    return db


UNREADABLE: dict[
    str, tuple[Callable[[Path, Path], Path], str]
] = {  # case -> (make the --db path, what the line says)
    "directory": (_directory, "is a directory"),
    "random-bytes": (_random_bytes, "not a database"),
    "truncated": (_truncated, "damaged"),
    "parent-is-a-file": (_under_a_file, "plain.txt"),
    "mode-000": (_no_permission, "permission denied"),
}


def _recorded_db(path: Path, sessions: int, response_end: int, *, project: bool) -> Path:
    """A ledger file of `sessions` succeeded sessions (responses of tokens 3 .. response_end - 1),
    projected or not, with its WAL folded into the file, so the file's bytes are the database."""

    async def record() -> None:
        async with Ledger.open(str(path)) as ledger:
            for index in range(sessions):
                handle = await ledger.create_session(f"s{index}", **{**KW, "uid": f"u{index}"})
                await handle.record_trajectory(
                    prompt_ids=[1, 2], response_ids=list(range(3, response_end))
                )
                await handle.complete()
            if project:
                await ledger.project()
        engine = create_engine(str(path))
        try:
            async with engine.connect() as conn:
                await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            await engine.dispose()

    asyncio.run(record())
    return path


@pytest.fixture(scope="module")
def good_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A healthy ledger database with projected sessions (the source of the damaged copies); 40
    sessions are enough pages that cutting the file in half loses some."""
    return _recorded_db(tmp_path_factory.mktemp("good") / "good.db", 40, 200, project=True)


@pytest.mark.parametrize("case", UNREADABLE)
@pytest.mark.parametrize(
    "verb", [["project"], ["sql", "SELECT COUNT(*) FROM events"], ["audit"]], ids=lambda v: v[0]
)
def test_an_unreadable_file_fails_in_one_line(
    good_db: Path, case: str, verb: list[str], tmp_path: Path
) -> None:
    make, says = UNREADABLE[case]
    db = make(tmp_path, good_db)
    line = one_line(cli(*verb, "--db", str(db), cwd=tmp_path))
    assert says in line, line


# -- PostgreSQL that does not answer, or lacks the database ------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _refused(url: str) -> tuple[str, tuple[str, ...]]:
    port = _free_port()
    return make_url(url).set(
        host="127.0.0.1", port=port, password="not-a-real-password"
    ).render_as_string(hide_password=False), ("cannot connect", f":{port}", "is the server running")


def _no_database(url: str) -> tuple[str, tuple[str, ...]]:
    name = f"rl_absent_{uuid.uuid4().hex[:8]}"
    return make_url(url).set(database=name).render_as_string(hide_password=False), (
        name,
        "does not exist",
        "createdb",
    )


def _no_role(url: str) -> tuple[str, tuple[str, ...]]:
    role = f"rl_absent_{uuid.uuid4().hex[:8]}"
    return make_url(url).set(username=role).render_as_string(hide_password=False), (
        role,
        "does not exist",
        "user",
    )


@pytest.mark.postgres
@pytest.mark.parametrize(
    "case", [_refused, _no_database, _no_role], ids=lambda f: f.__name__.strip("_")
)
@pytest.mark.parametrize(
    "verb", [["project"], ["metrics"], ["sql", "SELECT 1"]], ids=lambda v: v[0]
)
def test_an_unreachable_postgres_fails_in_one_line(
    pg_url: str, case: Callable[[str], tuple[str, tuple[str, ...]]], verb: list[str], tmp_path: Path
) -> None:
    url, says = case(pg_url)
    line = one_line(cli(*verb, "--db", url, cwd=tmp_path))
    for text in says:
        assert text in line, line
    assert "not-a-real-password" not in line


def test_a_missing_driver_names_the_extra_to_install(tmp_path: Path) -> None:
    hide = (
        "import sys\nsys.modules['asyncpg'] = None  # as if the postgres extra were not installed"
    )
    line = one_line(
        cli("project", "--db", "postgresql://ledger@127.0.0.1:1/ledger", cwd=tmp_path, prelude=hide)
    )
    assert "asyncpg" in line and "pip install -e '.[postgres]'" in line, line


def test_ctrl_c_stops_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    db = tmp_path / "demo.db"
    demo = subprocess.Popen(
        [sys.executable, "-m", "sessions.cli", "demo", "--db", str(db), "--steps", "1000"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        while (
            not Path(f"{db}-wal").exists() and time.monotonic() < deadline and demo.poll() is None
        ):
            time.sleep(0.1)  # the WAL appears once the demo is recording (a poll, not a guess)
        assert demo.poll() is None, "the demo ended before it was interrupted"
        demo.send_signal(signal.SIGINT)  # inside asyncio.run by now: its handler is in place
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    result = subprocess.CompletedProcess(demo.args, demo.returncode, out, err)
    assert "interrupted" in one_line(result, status=EXIT_INTERRUPTED)


# -- the mapping, for what a subprocess cannot easily provoke -----------------------------------


class _Bug(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/data/batch.pt"),
            ("no space left", "/data/batch.pt", "free some"),
        ),
        (
            sqlite3.OperationalError("database or disk is full"),
            ("no space left", "SQLite file ledger.db", "free some"),
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/data/batch.pt"),
            ("permission denied", "/data/batch.pt"),
        ),
        (
            ModuleNotFoundError("No module named 'transfer_queue'", name="transfer_queue"),
            ("pip install -e '.[transferqueue]'",),
        ),
        (ModuleNotFoundError("No module named 'rich'", name="rich"), ("rich", "pip install -e .")),
        (_Bug("line one\n  line two"), ("internal error", "_Bug", "line one line two", "--debug")),
        (
            ExceptionGroup("two", [ValueError("first problem"), ValueError("second")]),  # noqa: F821 (3.11+)
            ("first problem", "1 more"),
        ),
        (KeyboardInterrupt(), ("interrupted",)),
    ],
    ids=[
        "disk-full",
        "sqlite-disk-full",
        "permission",
        "optional-extra",
        "core-module",
        "bug",
        "group",
        "ctrl-c",
    ],
)
def test_reason_names_the_problem_in_one_line(error: BaseException, says: tuple[str, ...]) -> None:
    line = reason(error, ["sqlite+aiosqlite:///ledger.db"])
    assert "\n" not in line and "  " not in line
    for text in says:
        assert text in line, line


# -- the cases of issue 15, item 4: one line, non-zero, no traceback, nothing changed on disk ----


def _digests(folder: Path) -> dict[str, str]:
    """Every file under `folder` and a digest of its bytes (what 'nothing changed on disk' compares)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def unprojected_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger whose events were never projected, so `project` and `metrics` have writing to do."""
    return _recorded_db(
        tmp_path_factory.mktemp("unprojected") / "ledger.db", 60, 400, project=False
    )


def _fresh_copy(db: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return _copy(db, folder)


WRITING_VERBS = {
    "project": ["project"],
    "metrics": ["metrics"],
}  # metrics projects first, as docs/design.md §11 says


@contextlib.contextmanager
def _immutable(path: Path) -> Iterator[None]:
    """Make `path` unwritable even for root (`chattr +i`), or by its mode for anyone else."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("cannot make a file immutable here (chattr +i refused)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        return
    path.chmod(0o444)
    yield


@pytest.mark.parametrize("verb", WRITING_VERBS)
def test_a_read_only_file_with_events_to_project_fails_in_one_line(
    unprojected_db: Path, verb: str, tmp_path: Path
) -> None:
    db = _fresh_copy(unprojected_db, tmp_path / "data")
    with _immutable(db):
        before = hashlib.sha256(db.read_bytes()).hexdigest()
        line = one_line(cli(*WRITING_VERBS[verb], "--db", str(db), cwd=tmp_path))
        assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert "read-only" in line and str(db) in line and "copy it somewhere writable" in line, line


@pytest.mark.parametrize("verb", WRITING_VERBS)
def test_a_read_only_uri_with_events_to_project_fails_in_one_line(
    unprojected_db: Path, verb: str, tmp_path: Path
) -> None:
    db = _fresh_copy(unprojected_db, tmp_path / "data")
    before = _digests(tmp_path / "data")
    line = one_line(
        cli(*WRITING_VERBS[verb], "--db", f"sqlite:///file:{db}?mode=ro&uri=true", cwd=tmp_path)
    )
    assert "opens SQLite file" in line and "read-only" in line and "drop mode=ro" in line, line
    assert _digests(tmp_path / "data")[db.name] == before[db.name]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs mounted for the test (root only), so a full disk is a real ENOSPC."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _fill(disk: Path, leave_kb: int) -> None:
    """Take the disk's free space down to about `leave_kb` kilobytes."""
    free_kb = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize // 1024
    with open(disk / "filler", "wb") as filler:
        try:
            filler.write(b"\0" * max(0, free_kb - leave_kb) * 1024)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


@pytest.mark.parametrize("leave_kb", [0, 64], ids=["full", "nearly-full"])
@pytest.mark.parametrize("verb", WRITING_VERBS)
def test_a_full_disk_fails_in_one_line(
    unprojected_db: Path, tiny_disk: Path, verb: str, leave_kb: int, tmp_path: Path
) -> None:
    """Nearly full: SQLite's own "database or disk is full"; full: it cannot even make its -shm file
    and says "disk I/O error", which the file system then explains."""
    db = _fresh_copy(unprojected_db, tiny_disk)
    _fill(tiny_disk, leave_kb)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    line = one_line(cli(*WRITING_VERBS[verb], "--db", str(db), cwd=tmp_path))
    assert "no space left" in line and str(db) in line and "free some disk space" in line, line
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


@contextlib.contextmanager
def _hanging_up_server() -> Iterator[int]:
    """A TCP server that reads a client's first message and hangs up: a connection terminated during open."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                continue
            with client:
                client.settimeout(5)
                with contextlib.suppress(OSError):
                    client.recv(1024)

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        worker.join(5)
        server.close()


@pytest.mark.parametrize(
    "verb", [["project"], ["metrics"], ["sql", "SELECT 1"]], ids=lambda v: v[0]
)
def test_a_connection_terminated_during_open_fails_in_one_line(
    verb: list[str], tmp_path: Path
) -> None:
    with _hanging_up_server() as port:
        line = one_line(
            cli(*verb, "--db", f"postgresql://ledger@127.0.0.1:{port}/ledger", cwd=tmp_path)
        )
    assert (
        "lost the connection" in line and f":{port}" in line and "run the command again" in line
    ), line


@pytest.mark.parametrize("out", ["missing-folder/batch.pt", "a-folder"])
def test_export_into_a_missing_folder_fails_in_one_line(
    good_db: Path, out: str, tmp_path: Path
) -> None:
    db = _copy(good_db, tmp_path)
    (tmp_path / "a-folder").mkdir()
    before = _digests(tmp_path)
    line = one_line(
        cli(
            "export",
            "--partition",
            "val",
            "--step",
            "0",
            "--out",
            out,
            "--db",
            str(db),
            cwd=tmp_path,
        )
    )
    assert f"--out {out}" in line and ("does not exist" in line or "is a directory" in line), line
    assert _digests(tmp_path) == before


def test_a_postgres_url_without_the_extra_names_it(tmp_path: Path) -> None:
    """The real entry point, with asyncpg made unimportable by a sitecustomize (as if never installed)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['asyncpg'] = None\n")
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), env.get("PYTHONPATH")]))
    for verb in (["metrics"], ["sql", "SELECT 1"], ["migrate"]):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "sessions.cli",
                *verb,
                "--db",
                "postgresql://ledger@127.0.0.1:1/ledger",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = one_line(result)
        assert (
            "asyncpg is not installed" in line
            and "pip install -e '.[postgres]'" in line
            and "rollout-ledger[" not in line
        ), line


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("SELEC * FROM events", ("'SELEC'", "typo")),
        ("SELECT * FRM events", ("syntax error", "FRM")),
    ],
    ids=["misspelt-verb", "misspelt-clause"],
)
def test_a_misspelt_query_is_a_syntax_error_not_a_refused_write(
    good_db: Path, query: str, says: tuple[str, ...], tmp_path: Path
) -> None:
    db = _copy(good_db, tmp_path)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    line = one_line(cli("sql", query, "--db", str(db), cwd=tmp_path))
    assert "refused" not in line and "read-only" not in line, line
    for text in says:
        assert text in line, line
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_debug_shows_the_traceback_of_a_refused_open_too(tmp_path: Path) -> None:
    result = cli("--debug", "metrics", "--db", "mistyped.db", cwd=tmp_path)
    assert result.returncode != 0
    assert (
        "Traceback (most recent call last)" in result.stderr
        and "SchemaError: no SQLite file mistyped.db" in result.stderr
    )
    assert not (tmp_path / "mistyped.db").exists()
