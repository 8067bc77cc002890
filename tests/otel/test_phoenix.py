"""The export against a real viewer: Arize Phoenix, started for the test session (`phoenix.py`).

A run of the demo's agents and a step of sessions that record their model calls (`recording.py`)
are sent into Phoenix with `rollout-ledger export-otel`, then read back through Phoenix's REST
API and compared with the ledger's own tables: every session is a trace there, a failed session
carries its reason, origin and placeholder flag, call spans add up to the session's tokens and
to the `model_calls` view, hostile text is stored as its escapes, and a second export adds no
span. One test opens the failed session's page in headless Chromium and keeps a screenshot.

Phoenix stores what it receives a moment later (a bulk inserter): every read waits for a
condition with a deadline. That a second export added nothing is read after a later export, of
a session recorded afterwards, has arrived: Phoenix inserts in the order it received.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("ROLLOUT_LEDGER_REQUIRE_PHOENIX") != "1":  # where required, a missing extra fails
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install -e '.[otel]'")

from sqlalchemy import text  # noqa: E402

from sessions import Ledger  # noqa: E402
from sessions.otel import attributes as A  # noqa: E402
from sessions.otel import ids  # noqa: E402
from sessions.report.text import visible  # noqa: E402
from tests.conftest import fresh_database  # noqa: E402
from tests.otel.phoenix import (  # noqa: E402
    ARTIFACTS,
    CHROMIUM,
    REPO,
    VENV,
    Phoenix,
    require,
    running_phoenix,
    wait_until,
)
from tests.otel.recording import HOSTILE, RUN, record_call_step, record_run  # noqa: E402

pytestmark = pytest.mark.phoenix

#: Phoenix's bulk inserter flushes about every second; this is for a loaded machine.
ARRIVAL_DEADLINE_S = 180.0
SENTINEL_STEP = 9


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    with running_phoenix(tmp_path_factory.mktemp("phoenix")) as running:
        yield running


@dataclass
class Sent:
    db_url: str
    first_output: str
    spans: list[dict[str, Any]] = field(default_factory=list)
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    view_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    sent_spans: int = 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]
    done = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


async def _record(url: str) -> None:
    async with Ledger.open(url, run=RUN) as ledger:
        await record_run(ledger)


async def _record_sentinel(url: str) -> None:
    async with Ledger.open(url, run=RUN) as ledger:
        await record_call_step(ledger, step=SENTINEL_STEP, prefix="sentinel")
        await ledger.project()


async def _ledger_facts(url: str, sent: Sent) -> None:
    async with Ledger.open(url, run=RUN) as ledger, ledger.engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT session_id, state, failure_reason, failure_origin, placeholder "
                "FROM sessions WHERE run = :run AND global_step <> :sentinel"
            ),
            {"run": RUN, "sentinel": SENTINEL_STEP},
        )
        sent.sessions = {row.session_id: dict(row._mapping) for row in rows}
        sums = await conn.execute(
            text(
                "SELECT session_id, SUM(COALESCE(prompt_tokens, 0)), "
                "SUM(COALESCE(response_tokens, 0)) FROM model_calls WHERE run = :run "
                "AND global_step <> :sentinel GROUP BY session_id"
            ),
            {"run": RUN, "sentinel": SENTINEL_STEP},
        )
        sent.view_tokens = {sid: (int(p), int(r)) for sid, p, r in sums}


@pytest.fixture(scope="module")
def sent(phoenix: Phoenix, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sent]:
    with fresh_database("sqlite", tmp_path_factory.mktemp("phoenix-ledger")) as url:
        asyncio.run(_record(url))
        endpoint = f"{phoenix.url}/v1/traces"
        first = _cli("export-otel", "--db", url, "--endpoint", endpoint, "--run", RUN)
        out = Sent(url, first.stdout)
        out.sent_spans = int(re.search(r"(\d+) spans", first.stdout).group(1))
        wait_until(
            lambda: len(phoenix.spans(RUN)) >= out.sent_spans,
            deadline_s=ARRIVAL_DEADLINE_S,
            what=f"Phoenix storing the {out.sent_spans} spans sent",
        )
        # again, then a session recorded afterwards: once it is there, so is the repeat
        _cli("export-otel", "--db", url, "--endpoint", endpoint, "--run", RUN)
        asyncio.run(_record_sentinel(url))
        _cli(
            "export-otel",
            "--db",
            url,
            "--endpoint",
            endpoint,
            "--run",
            RUN,
            "--steps",
            str(SENTINEL_STEP),
        )
        wait_until(
            lambda: any(
                s["parent_id"] is None
                and s["attributes"].get(A.SESSION_ID, "").startswith("sentinel-")
                for s in phoenix.spans(RUN)
            ),
            deadline_s=ARRIVAL_DEADLINE_S,
            what="Phoenix storing the sessions exported after the repeat",
        )
        out.spans = [
            s
            for s in phoenix.spans(RUN)
            if not s["attributes"].get(A.CONVERSATION_ID, "").startswith("sentinel-")
        ]
        asyncio.run(_ledger_facts(url, out))
        yield out


def _by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[span["context"]["trace_id"]].append(span)
    return traces


def _root(spans: list[dict[str, Any]]) -> dict[str, Any]:
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == 1
    return roots[0]


def test_every_session_of_the_run_is_a_trace_in_phoenix(sent: Sent) -> None:
    assert sent.first_output.startswith(f"exported {len(sent.sessions)} sessions")
    traces = _by_trace(sent.spans)
    assert set(traces) == {f"{ids.trace_id(sid):032x}" for sid in sent.sessions}
    for sid in sent.sessions:
        root = _root(traces[f"{ids.trace_id(sid):032x}"])
        assert root["attributes"][A.SESSION_ID] == sid
        assert root["attributes"][A.OUTCOME] == sent.sessions[sid]["state"]
        assert root["span_kind"] == "AGENT"


def test_a_second_export_adds_no_span(sent: Sent) -> None:
    assert len(sent.spans) == sent.sent_spans
    keys = [(s["context"]["trace_id"], s["context"]["span_id"]) for s in sent.spans]
    assert len(set(keys)) == len(keys)


def test_a_failed_session_carries_its_reason_and_placeholder_in_phoenix(sent: Sent) -> None:
    traces = _by_trace(sent.spans)
    failed = {sid: row for sid, row in sent.sessions.items() if row["state"] == "failed"}
    assert len(failed) >= 5
    for sid, row in failed.items():
        root = _root(traces[f"{ids.trace_id(sid):032x}"])
        assert root["status_code"] == "ERROR"
        assert root["status_message"].startswith(f"{row['failure_reason']}: ")
        attributes = root["attributes"]
        assert attributes[A.FAILURE_REASON] == row["failure_reason"]
        assert attributes[A.FAILURE_ORIGIN] == row["failure_origin"]
        assert attributes[A.PLACEHOLDER] is bool(row["placeholder"])
        assert any(e["name"] == "exception" for e in root["events"])


def test_call_spans_add_up_to_the_sessions_tokens_in_phoenix(sent: Sent) -> None:
    traces = _by_trace(sent.spans)
    assert len(sent.view_tokens) == 5
    for sid, (prompt, response) in sent.view_tokens.items():
        spans = traces[f"{ids.trace_id(sid):032x}"]
        calls = [s for s in spans if s["span_kind"] == "LLM"]
        assert calls
        assert sum(s["attributes"].get(A.INPUT_TOKENS, 0) for s in calls) == prompt
        assert sum(s["attributes"].get(A.OUTPUT_TOKENS, 0) for s in calls) == response
        root = _root(spans)["attributes"]
        assert (root[A.INPUT_TOKENS], root[A.OUTPUT_TOKENS]) == (prompt, response)


def test_hostile_text_is_stored_as_its_escapes(sent: Sent) -> None:
    root = _root(_by_trace(sent.spans)[f"{ids.trace_id('calls-sandbox'):032x}"])
    assert root["attributes"][A.DATA_SOURCE] == visible(HOSTILE)
    assert "\x1b" not in root["status_message"] and "\\x1b" in root["status_message"]


def _open_page(phoenix: Phoenix, session_id: str, name: str, expected: list[str]) -> dict[str, Any]:
    """Phoenix's page for the session's trace in headless Chromium, once every `expected` text
    is visible on it; the screenshot kept as ARTIFACTS/<name>."""
    require(VENV / "bin" / "python", "the Phoenix virtualenv")
    require(CHROMIUM, "Chromium (Debian's chromium package)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / name
    screenshot.unlink(missing_ok=True)
    trace = f"{ids.trace_id(session_id):032x}"
    shown = subprocess.run(
        [
            str(VENV / "bin" / "python"),
            str(Path(__file__).with_name("phoenix_page.py")),
            f"{phoenix.url}/redirects/traces/{trace}",
            str(CHROMIUM),
            str(screenshot),
            *expected,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-3000:]
    assert screenshot.stat().st_size > 10_000
    page = json.loads(shown.stdout.strip().splitlines()[-1])
    assert f"/traces/{trace}" in page["url"]
    return page


def test_the_failed_sessions_page_shows_its_status_and_error(sent: Sent, phoenix: Phoenix) -> None:
    page = _open_page(
        phoenix,
        "calls-call-failed",
        "otel-phoenix-failed-session.png",
        [
            "session calls-call-failed",
            "Error",
            "connection_error: the model server went away",
            "attempt 1",
        ],
    )
    assert page["dialogs"] == []


def test_hostile_text_shows_as_text_on_the_page(sent: Sent, phoenix: Phoenix) -> None:
    """The message with a script tag and terminal escapes is shown as its characters: the tag
    as text (no alert), the escapes as `\\x1b` sequences."""
    page = _open_page(
        phoenix,
        "calls-sandbox",
        "otel-phoenix-hostile-text.png",
        ["session calls-sandbox", "attempt 1", visible(HOSTILE)[:40]],
    )
    assert page["dialogs"] == []
    assert "<script>alert('x')</script>" in page["body"]
    assert "\x1b" not in page["body"] and "\\x1b[31m" in page["body"]
