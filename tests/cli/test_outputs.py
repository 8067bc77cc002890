"""No verb writes over a ledger, or over a file it did not make (docs/design.md §11).

Every writing verb (`export`, `export-dataset`, `report`) is tried against the ledger's own file
by several spellings (relative, `./`, absolute, a symlink, its `-wal` / `-shm`), another ledger,
and a foreign file; the ledger must be untouched and readable afterwards. Then what is written
goes beside the target and is swapped in whole: a killed writer's leftovers are removed by the next
run, and SIGTERM cleans up as Ctrl-C does.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessions import Ledger
from sessions.cli.main import main
from sessions.export.outputs import OutputRefused, check_target, clean_stale, replaced_folder

KW = {"uid": "u1", "group_size": 1, "partition": "val", "global_step": 0}


async def _record(db: Path) -> None:
    async with Ledger.open(str(db)) as ledger:
        for i in range(2):
            async with ledger.session(f"s{i}", **{**KW, "uid": f"u{i}", "session_index": 0}) as s:
                await s.record_trajectory(
                    prompt_ids=[1, 2], response_ids=[3], response_mask=[1], num_turns=1
                )
                await s.post_reward(1.0)
        await ledger.project()


@pytest.fixture(scope="module")
def ledger_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("outputs")
    asyncio.run(_record(folder / "demo.db"))
    asyncio.run(_record(folder / "other.db"))
    return folder


@pytest.fixture()
def here(ledger_folder: Path, tmp_path: Path) -> Iterator[Path]:
    """A copy of the ledgers in the test's own folder, as the working directory."""
    for name in ("demo.db", "other.db"):
        shutil.copy(ledger_folder / name, tmp_path / name)
    (tmp_path / "link.db").symlink_to(tmp_path / "demo.db")
    (tmp_path / "notes.txt").write_text("mine\n")
    before = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(before)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


WRITERS = {
    "export": ["export", "--partition", "val", "--step", "0"],
    "export-dataset": ["export-dataset"],
    "report": ["report", "--no-project"],
}
LEDGER_TARGETS = [
    "demo.db",
    "./demo.db",
    "{abs}",
    "link.db",
    "demo.db-wal",
    "demo.db-shm",
    "other.db",
]


@pytest.mark.parametrize("target", LEDGER_TARGETS)
@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_no_writing_verb_writes_over_a_ledger_even_when_forced(
    here: Path, verb: str, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = target.format(abs=here / "demo.db")
    before = {name: _digest(here / name) for name in ("demo.db", "other.db")}
    for force in ([], ["--force"]):
        status = main([*WRITERS[verb], "--db", "demo.db", "--out", out, *force])
        err = capsys.readouterr().err
        assert status != 0, f"{verb} --out {out} {force} was allowed"
        assert err.count("\n") == 1 and "ledger" in err, err
    assert {name: _digest(here / name) for name in before} == before
    assert not (here / "demo.db-wal").exists() or (here / "demo.db-wal").stat().st_size == 0


@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_a_foreign_file_is_replaced_only_with_force(
    here: Path, verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if verb == "report":
        target = here / "site"
        target.mkdir()
        (target / "index.html").write_text("<html>someone else's page</html>")
    else:
        target = here / ("foreign.parquet" if verb == "export-dataset" else "foreign.pt")
        target.write_bytes(b"not ours")
    status = main([*WRITERS[verb], "--db", "demo.db", "--out", str(target)])
    err = capsys.readouterr().err
    assert status != 0 and "--force" in err, err
    assert main([*WRITERS[verb], "--db", "demo.db", "--out", str(target), "--force"]) == 0
    capsys.readouterr()
    # what the verb wrote is now its own: replaced again without --force
    assert main([*WRITERS[verb], "--db", "demo.db", "--out", str(target)]) == 0


def test_a_report_never_replaces_a_folder_holding_other_files(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for force in ([], ["--force"]):
        status = main(["report", "--db", "demo.db", "--no-project", "--out", ".", *force])
        err = capsys.readouterr().err
        assert status != 0 and "new or empty folder" in err, err
    assert (here / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("flag_value", ["", "  "])
def test_empty_output_paths_are_refused(here: Path, flag_value: str) -> None:
    with pytest.raises(OutputRefused, match="empty"):
        check_target(flag_value, flag="--out")


def test_stale_partials_of_dead_writers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    target = tmp_path / "rows.parquet"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    gone = int(dead.stdout)
    stale = tmp_path / f".rows.parquet.{gone}.0a0b0c0d.part"
    legacy = tmp_path / ".rows.parquet.k3j_x9q2.part"  # mkstemp's name, before names held a pid
    live = tmp_path / f".rows.parquet.{os.getpid()}.0e0f0a0b.part"
    other = tmp_path / f".other.parquet.{gone}.0a0b0c0d.part"
    for path in (stale, legacy, live, other):
        path.write_bytes(b"x")
    clean_stale(target)
    assert not stale.exists() and not legacy.exists()
    assert live.exists() and other.exists()


def test_a_folder_swap_cut_between_its_renames_is_put_back(tmp_path: Path) -> None:
    target = tmp_path / "report"
    target.mkdir()
    (target / "index.html").write_text("old")
    with pytest.raises(RuntimeError), replaced_folder(target) as new:
        (new / "index.html").write_text("half")
        raise RuntimeError("killed while drawing")
    assert (target / "index.html").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report"]
    # a writer that died after moving the old folder aside, before renaming the new one in
    aside = tmp_path / ".report.999999999.00000000.old"
    os.replace(target, aside)
    clean_stale(target)
    assert (target / "index.html").read_text() == "old" and not aside.exists()


def test_sigterm_during_an_export_leaves_no_partial_file(here: Path) -> None:
    """A dataset export stopped by SIGTERM cleans up as Ctrl-C does: no `.part` file is left, the
    exit is 143 with one line, and the old file at the path is untouched."""
    # The first page's write waits, in the writer's thread, until the process has taken the
    # SIGTERM (the CLI's handler sets `_terminated` before it interrupts the verb): the export
    # cannot finish first, however loaded the machine is.
    script = (
        "import sys\n"
        "import sessions.export.writers as w\n"
        "from sessions.cli.errors import _terminated\n"
        "slow = w.JsonlWriter.write\n"
        "def write(self, page, rows):\n"
        "    print('writing', flush=True)\n"
        "    assert _terminated.wait(120), 'no SIGTERM came'\n"
        "    slow(self, page, rows)\n"
        "w.JsonlWriter.write = write\n"
        "from sessions.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    (here / "rows.jsonl").write_text("")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "export-dataset", "--db", "demo.db", "--out", "rows.jsonl"],
        cwd=here,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert "writing" in proc.stdout.readline()  # the export is inside its write now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "SIGTERM" in err and err.strip().count("\n") == 0, err
    assert [p.name for p in here.iterdir() if p.name.endswith(".part")] == []
    assert (here / "rows.jsonl").read_text() == ""
