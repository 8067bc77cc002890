"""The gateway's tests: a ledger on each backend, a stand-in server, the gateway in front of it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sessions.gateway.standin import StandIn, serving
from tests.conftest import BACKENDS, fresh_database


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as fresh:
        yield fresh


@contextlib.asynccontextmanager
async def stack(url: str, **options: Any) -> AsyncIterator[tuple[Any, StandIn]]:
    """A ledger at `url`, the stand-in server and a gateway in front of it, in this loop."""
    from sessions.gateway.server import serve
    from sessions.ledger import Ledger

    standin = StandIn()
    async with (
        Ledger.open(url, run="gw") as ledger,
        serving(standin.app) as upstream,
        serve(ledger, [upstream], **options) as gateway,
    ):
        yield gateway, standin


def identity(step: int = 0, index: int = 0, group_size: int = 1, uid: str = "p0") -> dict[str, Any]:
    return {
        "uid": uid,
        "session_index": index,
        "group_size": group_size,
        "partition": "train",
        "global_step": step,
    }
