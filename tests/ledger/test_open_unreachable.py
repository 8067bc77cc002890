"""`Ledger.open` of a PostgreSQL server that does not answer (issue 40, case 8; docs/design.md §8).

A refused connection (nothing listens on the port: a server not up yet, or restarting) is retried
as an open's transient faults are (`OPEN_ATTEMPTS`), then raised as one `DatabaseUnreachableError`
(a `LedgerError`) naming the server and what to check — not a bare `ConnectionRefusedError`. No
server is needed: port 1 on this host refuses at once.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from sessions import Ledger, LedgerError
from store import OPEN_ATTEMPTS
from store.errors import DatabaseUnreachableError
from tests.cli.test_errors import cli, one_line


def _refusing_port() -> int:
    """A local port nothing listens on: bound once, then closed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_open_retries_a_refused_connection_then_names_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _refusing_port()
    caplog.set_level(logging.INFO, logger="store.retry")
    with pytest.raises(DatabaseUnreachableError) as raised:
        async with Ledger.open(f"postgresql://nobody@127.0.0.1:{port}/test"):
            pytest.fail("opened a server that is not there")
    error = raised.value
    assert isinstance(error, LedgerError) and isinstance(error, ConnectionError)
    message = str(error)
    assert f"127.0.0.1:{port}" in message and "pg_isready" in message, message
    assert f"after {OPEN_ATTEMPTS} attempts" in message, message
    assert isinstance(error.__cause__, OSError)
    retries = [r for r in caplog.records if "failed transiently" in r.getMessage()]
    assert len(retries) == OPEN_ATTEMPTS - 1, [r.getMessage() for r in retries]


async def test_an_unknown_host_is_named_without_retrying(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="store.retry")
    with pytest.raises(DatabaseUnreachableError, match="no-such-host.invalid"):
        async with Ledger.open("postgresql://nobody@no-such-host.invalid:5432/test"):
            pytest.fail("opened a server that is not there")
    assert not [r for r in caplog.records if "failed transiently" in r.getMessage()]


def test_the_cli_names_the_server_after_its_retries(tmp_path: Path) -> None:
    """One line, after the retries (their notes are INFO: the error names how many there were)."""
    port = _refusing_port()
    line = one_line(
        cli("metrics", "--db", f"postgresql://nobody@127.0.0.1:{port}/test", cwd=tmp_path)
    )
    assert line.startswith("cannot connect to PostgreSQL"), line
    assert f"127.0.0.1:{port}" in line and "pg_isready" in line, line
    assert f"after {OPEN_ATTEMPTS} attempts" in line and "is the server running" in line, line
