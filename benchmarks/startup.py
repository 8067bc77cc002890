"""CLI start-up (issue 28, "a CLI that starts fast"): each verb's wall time as a user runs it.

Every figure is a whole `python -m sessions.cli VERB` in a fresh interpreter, against a small
demo ledger whose projector is at the log's end, beside two baselines run in the same rounds:

* `python -c pass`                       the interpreter alone
* `import sqlalchemy.ext.asyncio, aiosqlite`  the database stack every verb that opens a ledger
                                         reads through: the floor for `metrics`, `history`, `sql`

The rounds interleave the commands (a round runs each once), so a load that comes and goes
shifts them alike. Target: `--help` and the read verbs in well under half a second.

    python -m benchmarks --full --only startup

On a loaded machine the walls move by several times (the floor alone measured 2-7 s at a load
of 12-20); compare a change by the instructions one run of a verb executes instead, before and
after on the same ledger, after one warm-up run for the bytecode caches:

    valgrind --tool=callgrind python -m sessions.cli sql --db FILE "SELECT 1 AS one"
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.common import Config, Report, log, median, scratch_dir

WORKLOAD = "startup"
#: Rounds per figure at `--full` (each command runs once a round); `--quick` uses `cfg.reps`.
FULL_ROUNDS = 10
TARGET_S = 0.5
FLOOR = "import sqlalchemy.ext.asyncio, aiosqlite"


def _commands(db: str, session_id: str) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "sessions.cli"]
    return {
        "python -c pass (interpreter)": [sys.executable, "-c", "pass"],
        "database stack import (floor)": [sys.executable, "-c", FLOOR],
        "--help": [*cli, "--help"],
        "metrics": [*cli, "metrics", "--db", db],
        "history": [*cli, "history", "--db", db, session_id],
        "sql": [*cli, "sql", "--db", db, "SELECT 1 AS one"],
    }


def _wall(argv: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} exited {done.returncode}: {done.stderr[-500:]}")
    return seconds


def run(cfg: Config, report: Report) -> None:
    # --tiny is CI's smoke run: one round shows every figure is there, which is all it asserts
    rounds = {"full": FULL_ROUNDS, "tiny": 1}.get(cfg.mode, cfg.reps)
    with scratch_dir(cfg, WORKLOAD) as folder:
        db = str(folder / "ledger.db")
        demo = [sys.executable, "-m", "sessions.cli", "demo", "--db", db, "--run", "startup"]
        subprocess.run(
            [*demo, "--steps", "1", "--prompts", "4", "--group-size", "2"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        session_id = _first_session(db)
        commands = _commands(db, session_id)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(rounds):
            for name, argv in commands.items():
                times[name].append(_wall(argv))
    floor = median(times["database stack import (floor)"])
    for name, samples in times.items():
        value = median(samples)
        verb = name in ("--help", "metrics", "history", "sql")
        report.add(
            WORKLOAD,
            f"{name} (s)",
            value,
            "s",
            target=f"<= {TARGET_S} s" if verb else None,
            goal=("<=", TARGET_S) if verb else None,
        )
        if name in ("metrics", "history", "sql"):
            ratios = [a / b for a, b in zip(samples, times["database stack import (floor)"])]
            report.add(WORKLOAD, f"ratio {name} / database stack import", median(ratios), "x")
        log(
            f"  {name}: {1000 * value:.0f} ms (min {1000 * min(samples):.0f}, max {1000 * max(samples):.0f})"
        )
    log(f"  floor (the database stack's import): {1000 * floor:.0f} ms")


def _first_session(db: str) -> str:
    import sqlite3

    with sqlite3.connect(db) as conn:
        (session_id,) = conn.execute(
            "SELECT session_id FROM sessions ORDER BY created_position LIMIT 1"
        ).fetchone()
    return str(session_id)
