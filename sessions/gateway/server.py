"""Running a gateway: its routes on uvicorn, in the caller's event loop (the ledger's), bound to
127.0.0.1 unless told otherwise — embeddable in a test or a training script, and what the
`gateway` verb runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from sessions.errors import ConfigError, LedgerTimeout
from sessions.gateway.app import build_app
from sessions.gateway.gateway import Gateway
from sessions.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from sessions.ledger import Ledger

__all__ = ["START_TIMEOUT_S", "serve"]

#: How long `serve` waits for the server to listen before it gives up.
START_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def serve(
    ledger: Ledger,
    upstreams: Sequence[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    settings: GatewaySettings | None = None,
    **options: Any,
) -> AsyncIterator[Gateway]:
    """A gateway serving `ledger`'s sessions on `host:port` (port 0: a free one;
    `gateway.base_url` says which) until the block ends; `settings`, or its fields as keywords
    beside `upstreams`. Leaving the block stops the server and waits for calls being settled."""
    import uvicorn

    if settings is None:
        settings = GatewaySettings(upstreams=list(upstreams or ()), **options)
    gateway = Gateway(ledger, settings)
    config = uvicorn.Config(
        build_app(gateway),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        # agents' pooled connections stay open longer than their clients keep them (httpx, and
        # so the openai SDK: 5 s), so a client never sends on a connection the gateway is closing
        timeout_keep_alive=75,
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    gateway.serving = task
    try:
        await _started(server, task)
        bound = server.servers[0].sockets[0].getsockname()
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        shown = f"[{shown}]" if ":" in shown else shown
        gateway.base_url = f"http://{shown}:{bound[1]}"
        yield gateway
    finally:
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await task
        await gateway.close()


async def _started(server: Any, task: asyncio.Future[Any]) -> None:
    """Wait (bounded) until uvicorn listens; a clear error if it stopped first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while not server.started:  # uvicorn sets a flag, no event: a condition with a deadline
        if task.done():
            with contextlib.suppress(SystemExit):  # uvicorn exits when it cannot bind
                task.result()
            raise ConfigError(
                f"the gateway could not listen on {server.config.host}:{server.config.port} "
                "(in use, or not an address of this machine): pick another --host/--port"
            )
        if loop.time() > deadline:
            raise LedgerTimeout(f"the gateway's server did not listen within {START_TIMEOUT_S:g}s")
        await asyncio.sleep(0.01)
