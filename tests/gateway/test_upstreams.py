"""Several inference servers: sessions spread over them and stick to one; a server that refuses
connections is taken out and the call goes to another; with none left the call fails, recorded."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from sessions.gateway.server import serve
from sessions.gateway.standin import StandIn, serving
from sessions.ledger import Ledger
from tests.gateway.conftest import identity
from tests.gateway.test_recording import CONVERSATION, client


def refused_url() -> str:
    """A local address nothing listens on (a port bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def gateway_over(url: str, upstreams: list[str]) -> AsyncIterator[Any]:
    async with Ledger.open(url, run="gw") as ledger, serve(ledger, upstreams) as gateway:
        yield gateway


async def test_sessions_spread_over_servers_and_stick_to_one(url: str) -> None:
    first, second = StandIn(), StandIn()
    async with serving(first.app) as a, serving(second.app) as b, gateway_over(url, [a, b]) as gw:
        for n in range(4):
            async with gw.session(f"s{n}", **identity(uid=f"u{n}")) as s:
                agent = client(s)
                for _ in range(3):
                    await agent.chat.completions.create(model="m", messages=CONVERSATION)
                servers = {e.server for e in s.handle.view.recorded_calls()}
                assert len(servers) == 1  # a session's calls stay on one server
        # one after another: an ended session no longer counts, so each found both servers
        # even and took the first
        assert (len(first.answered), len(second.answered)) == (12, 0)


async def test_concurrent_sessions_spread_over_servers(url: str) -> None:
    first, second = StandIn(), StandIn()
    async with serving(first.app) as a, serving(second.app) as b, gateway_over(url, [a, b]) as gw:
        async with contextlib.AsyncExitStack() as stack:
            sessions = [
                await stack.enter_async_context(gw.session(f"c{n}", **identity(uid=f"v{n}")))
                for n in range(4)
            ]
            for s in sessions:
                await client(s).chat.completions.create(model="m", messages=CONVERSATION)
        assert len(first.answered) == len(second.answered) == 2


async def test_a_server_that_refuses_connections_is_skipped(url: str) -> None:
    live = StandIn()
    dead = refused_url()
    async with serving(live.app) as up, gateway_over(url, [dead, up]) as gw:
        for n in range(3):
            async with gw.session(f"r{n}", **identity(uid=f"w{n}")) as s:
                await client(s).chat.completions.create(model="m", messages=CONVERSATION)
                (call,) = s.handle.view.recorded_calls()
                assert call.server == up
        assert len(live.answered) == 3


async def test_with_no_server_left_the_call_fails_and_is_recorded(url: str) -> None:
    async with gateway_over(url, [refused_url()]) as gw:
        async with gw.session("x", **identity()) as s:
            with pytest.raises(openai.InternalServerError) as raised:
                await client(s).chat.completions.create(model="m", messages=CONVERSATION)
            assert raised.value.status_code == 502
            assert s.handle.view.calls["c1"].failed
