"""A real Arize Phoenix for the tests: started from its own virtualenv on free ports with a
temporary working directory (its SQLite database in it), and read back through its REST API.

Phoenix lives in `.venv-phoenix` (tests/run.sh builds it from `phoenix-requirements.txt`), never
in the project's environment: its pins would otherwise decide the project's. Without it the
tests skip on a developer machine and fail where `ROLLOUT_LEDGER_REQUIRE_PHOENIX=1` (CI).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The Phoenix virtualenv (override: ROLLOUT_LEDGER_PHOENIX_VENV).
VENV = Path(os.environ.get("ROLLOUT_LEDGER_PHOENIX_VENV", REPO / ".venv-phoenix"))
#: Headless Chromium (Debian's `chromium` package; override: ROLLOUT_LEDGER_CHROMIUM).
CHROMIUM = Path(os.environ.get("ROLLOUT_LEDGER_CHROMIUM", "/usr/bin/chromium"))
#: Where the screenshots are kept (override: ROLLOUT_LEDGER_ARTIFACTS).
ARTIFACTS = Path(os.environ.get("ROLLOUT_LEDGER_ARTIFACTS", REPO / "test-artifacts"))
#: Phoenix's start on a loaded 2-core machine: about 20 s alone.
START_DEADLINE_S = 300.0


def require(path: Path, what: str) -> None:
    """Skip without `path` on a developer machine; fail where Phoenix is required (CI)."""
    if path.exists():
        return
    message = f"{what} is not at {path}: build it as tests/run.sh does"
    if os.environ.get("ROLLOUT_LEDGER_REQUIRE_PHOENIX") == "1":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(
    condition: Callable[[], Any], *, deadline_s: float, what: str, pause_s: float = 0.25
) -> Any:
    """`condition()`'s first truthy value, or fail naming `what` after the deadline."""
    until = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > until:
            pytest.fail(f"{what} did not happen within {deadline_s:.0f} s")
        time.sleep(pause_s)


@dataclass
class Phoenix:
    url: str
    log: Path

    def get(self, path: str, **query: Any) -> Any:
        address = f"{self.url}{path}"
        if query:
            address += "?" + urllib.parse.urlencode(query, doseq=True)
        with urllib.request.urlopen(address, timeout=30) as answer:
            return json.loads(answer.read())

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span of `project`, page by page (Phoenix's REST API, newest first)."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            query: dict[str, Any] = {"limit": 1000}
            if cursor:
                query["cursor"] = cursor
            try:
                page = self.get(f"/v1/projects/{urllib.parse.quote(project)}/spans", **query)
            except urllib.error.HTTPError as error:
                if error.code == 404:  # the project appears with its first span
                    return []
                raise
            out.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as answer:
                return answer.status == 200
        except (OSError, urllib.error.URLError):
            return False


@contextmanager
def running_phoenix(workdir: Path) -> Iterator[Phoenix]:
    """`phoenix serve` on free ports with `workdir` as its working directory, for the block."""
    require(VENV / "bin" / "phoenix", "Arize Phoenix (.venv-phoenix)")
    port, grpc_port = free_port(), free_port()
    log = workdir / "phoenix.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PHOENIX_", "OTEL_"))},
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [str(VENV / "bin" / "phoenix"), "serve"],
            cwd=workdir,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    phoenix = Phoenix(f"http://127.0.0.1:{port}", log)
    try:

        def up() -> bool:
            if process.poll() is not None:
                pytest.fail(f"phoenix serve exited with {process.returncode}:\n{log.read_text()}")
            return phoenix.healthy()

        wait_until(up, deadline_s=START_DEADLINE_S, what="Phoenix answering /healthz")
        yield phoenix
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
