"""`rollout-ledger gateway` as a process: the training side creates, rewards and ends a session
over HTTP; an agent's key works again after the gateway is stopped and started with its key file."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest

from sessions.gateway.standin import StandIn, serving
from sessions.ledger import Ledger
from tests.gateway.test_recording import CONVERSATION

_SERVING = re.compile(r"serving on (\S+) .* key (\S+)$")


@asynccontextmanager
async def gateway_process(
    url: str, upstream: str, key_file: Path
) -> AsyncIterator[tuple[str, str]]:
    """The verb in a process of its own; (its base URL, the training side's key)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sessions.cli",
        "gateway",
        "--db",
        url,
        "--upstream",
        upstream,
        "--port",
        "0",
        "--key-file",
        str(key_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode().strip()
        match = _SERVING.search(line)
        if match is None:
            stderr = await process.stderr.read() if process.stderr else b""
            raise AssertionError(f"no serving line: {line!r} {stderr.decode()!r}")
        yield match.group(1), match.group(2), process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)


async def test_the_verb_serves_sessions_the_training_side_makes_and_survives_a_restart(
    url: str, tmp_path: Path
) -> None:
    standin = StandIn()
    key_file = tmp_path / "gateway.key"
    identity = {
        "session_id": "h1",
        "uid": "p0",
        "session_index": 0,
        "group_size": 1,
        "partition": "train",
        "global_step": 0,
    }
    async with Ledger.open(url):  # the verb opens an existing ledger only, as `migrate` makes
        pass
    async with serving(standin.app) as upstream, httpx.AsyncClient() as http:
        async with gateway_process(url, upstream, key_file) as (base, admin, process):
            auth = {"authorization": f"Bearer {admin}"}
            refused = await http.post(base + "/sessions", json=identity)
            assert refused.status_code == 401  # the training side's paths need its key
            made = await http.post(base + "/sessions", json=identity, headers=auth)
            assert made.status_code == 201, made.text
            session = made.json()
            agent = openai.AsyncOpenAI(
                base_url=session["base_url"], api_key=session["api_key"], max_retries=0
            )
            await agent.chat.completions.create(model="m", messages=CONVERSATION)
            process.send_signal(signal.SIGTERM)  # a server's normal end: no error, exit 0
            await asyncio.wait_for(process.wait(), 60)
            stderr = await process.stderr.read() if process.stderr else b""
            assert process.returncode == 0, stderr.decode()
            assert b"error" not in stderr, stderr.decode()
        assert key_file.stat().st_mode & 0o077 == 0  # the key is its owner's only
        async with gateway_process(url, upstream, key_file) as (base, admin, _):
            auth = {"authorization": f"Bearer {admin}"}
            agent = openai.AsyncOpenAI(
                base_url=base + "/v1", api_key=session["api_key"], max_retries=0
            )
            await agent.chat.completions.create(model="m", messages=CONVERSATION)
            rewarded = await http.post(
                base + "/sessions/h1/reward", json={"reward": 1}, headers=auth
            )
            assert rewarded.status_code == 200, rewarded.text
            ended = await http.post(base + "/sessions/h1/end", json={}, headers=auth)
            assert ended.json() == {"session_id": "h1", "state": "succeeded"}
            with pytest.raises(openai.ConflictError, match="ended"):  # calls are refused now
                await agent.chat.completions.create(model="m", messages=CONVERSATION)
    async with Ledger.open(url) as ledger:
        handle = await ledger.load_session("h1")
        assert handle.state == "succeeded" and handle.view.reward == 1.0
        assert len(handle.view.recorded_calls()) == 2 == len(standin.answered)


def run_verb(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sessions.cli", "gateway", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_verb_refuses_bad_arguments_in_one_line(tmp_path: Path) -> None:
    import asyncio as aio

    db = tmp_path / "ledger.db"

    async def migrate() -> None:
        async with Ledger.open(str(db)):
            pass

    aio.run(migrate())
    upstream = ["--upstream", "http://127.0.0.1:9"]
    bad_url = run_verb("--db", str(db), "--upstream", "ftp://x", cwd=tmp_path)
    assert bad_url.returncode != 0 and "http://host:port" in bad_url.stderr
    (tmp_path / "bad.key").write_text("not hex\n")
    bad_key = run_verb("--db", str(db), *upstream, "--key-file", "bad.key", cwd=tmp_path)
    assert bad_key.returncode != 0 and "not a gateway key" in bad_key.stderr
    missing = run_verb("--db", str(tmp_path / "typo.db"), *upstream, cwd=tmp_path)
    assert missing.returncode != 0 and not (tmp_path / "typo.db").exists()
    for result in (bad_url, bad_key, missing):
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_verb_runs_on_uvloop_which_the_extra_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `gateway` extra brings uvloop, and the verb's event loop is uvloop's."""
    import argparse
    import importlib

    import uvloop  # the gateway extra's: a missing one fails here rather than slow the gateway

    main = importlib.import_module("sessions.cli.main")

    async def loop_module(args: argparse.Namespace) -> str:
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.setattr(main, "_dispatch", loop_module)
    assert main._run(argparse.Namespace(verb="gateway")).startswith("uvloop")
    assert main._run(argparse.Namespace(verb="metrics")).startswith("asyncio")
    assert uvloop.new_event_loop is not None
