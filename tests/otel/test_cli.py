"""`rollout-ledger export-otel` as a user runs it, against an OTLP/HTTP receiver on both backends:
an export with headers, a step range, a follower killed with SIGKILL and restarted (no gap, and
at most one page repeated, byte for byte), and arguments refused before the database opens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install -e '.[otel]'")

from sqlalchemy import text  # noqa: E402

from sessions import Ledger  # noqa: E402
from sessions.otel import attributes as A  # noqa: E402
from tests.otel.receiver import Receiver, otlp_receiver  # noqa: E402
from tests.otel.recording import RUN, record_call_step  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _command() -> list[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    env["COLUMNS"] = "200"
    return env


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _wait_until(condition: Callable[[], bool], *, deadline_s: float = 120.0) -> None:
    until = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < until, "the condition did not hold before the deadline"
        time.sleep(0.05)


async def _record(db_url: str, steps: range) -> set[str]:
    """Record the call steps `steps`; the terminal sessions of the database."""
    async with Ledger.open(db_url, run=RUN) as ledger:
        for step in steps:
            await record_call_step(ledger, step=step, prefix=f"s{step}")
        await ledger.project()
        async with ledger.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT session_id FROM sessions WHERE terminal_position IS NOT NULL")
            )
            return {row[0] for row in rows}


def _ids(receiver: Receiver) -> list[str]:
    return [r.attributes[A.SESSION_ID] for r in receiver.roots()]


async def test_an_export_sends_every_session_with_its_headers(db_url: str) -> None:
    expected = await _record(db_url, range(3))
    with otlp_receiver() as receiver:
        base = receiver.url.removesuffix("/v1/traces")  # the path is added when missing
        result = cli(
            "export-otel",
            "--db",
            db_url,
            "--endpoint",
            base,
            "--header",
            "x-api-key=not-a-secret",
            "--page-size",
            "4",
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"exported 15 sessions of run '{RUN}'")
        assert "the most recent run" in result.stdout
        assert sorted(_ids(receiver)) == sorted(expected)
        assert len(receiver.headers) == 4  # 15 sessions, 4 a request
        assert all(h["x-api-key"] == "not-a-secret" for h in receiver.headers)

        again = cli("export-otel", "--db", db_url, "--endpoint", receiver.url, "--steps", "1:1")
        assert again.returncode == 0, again.stderr
        step_one = _ids(receiver)[15:]
        assert sorted(step_one) == sorted(s for s in expected if s.startswith("s1-"))


def _follow(db_url: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *_command(),
            "export-otel",
            "--db",
            db_url,
            "--endpoint",
            url,
            "--follow",
            "--page-size",
            "2",
            "--poll",
            "0.05",
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_a_follower_killed_with_sigkill_resumes_without_gaps(db_url: str) -> None:
    await _record(db_url, range(3))
    with otlp_receiver() as receiver:
        first = _follow(db_url, receiver.url)
        try:
            _wait_until(lambda: len(receiver.roots()) >= 4)
        finally:
            first.kill()
            first.communicate(timeout=60)
        expected = await _record(db_url, range(3, 5))
        second = _follow(db_url, receiver.url)
        try:
            _wait_until(lambda: set(_ids(receiver)) == expected)
        finally:
            second.send_signal(signal.SIGINT)
            out, err = second.communicate(timeout=60)
        assert second.returncode in (0, 130), err
        assert "sessions in all" in out
        counts = Counter(_ids(receiver))
        assert set(counts) == expected, "no gap"
        repeated = [sid for sid, n in counts.items() if n > 1]
        assert len(repeated) <= 2 and set(counts.values()) <= {1, 2}, "at most one page again"
        sent: dict[tuple[bytes, bytes], set[bytes]] = {}
        for span in receiver.spans:
            sent.setdefault((span.trace_id, span.span_id), set()).add(span.raw)
        assert all(len(v) == 1 for v in sent.values()), "a page sent again is the same bytes"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--endpoint", "127.0.0.1:6006"), "not an http(s) URL"),
        (("--endpoint", "http://h", "--header", "novalue"), "KEY=VALUE"),
        (("--endpoint", "http://h", "--follow", "--steps", "1:2"), "--follow sends every step"),
        (("--endpoint", "http://h", "--name", "x"), "use it with --follow"),
        (("--endpoint", "http://h", "--steps", "3:1"), "after the last"),
    ],
)
def test_bad_arguments_are_refused_before_the_database_opens(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    missing = tmp_path / "absent.db"
    result = cli("export-otel", "--db", str(missing), *args)
    assert result.returncode != 0
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not missing.exists()
