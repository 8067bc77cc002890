"""The inference servers behind the gateway: one pooled HTTP client, sticky routing per session.

A session's calls go to one server while it answers (its prefix cache holds the conversation);
new sessions go to the server with the fewest sessions. A server that cannot be connected to is
taken out for `down_for_s` and the call goes to the next one: a connection that never opened sent
nothing, so the retry cannot run the call twice. Servers are configuration, never a request's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from sessions.errors import ConfigError, LedgerError

__all__ = ["NoServerAnswered", "Upstreams"]


class NoServerAnswered(LedgerError, ConnectionError):
    """Every configured server refused the connection (each named with its error)."""


@dataclass(slots=True)
class _Server:
    url: str
    sessions: int = 0
    down_until: float = 0.0


class Upstreams:
    """Route each session's calls to one of `urls` and send them with one pooled client."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        down_for_s: float = 10.0,
        max_connections: int = 1024,
    ) -> None:
        if not urls:
            raise ConfigError("the gateway needs at least one inference server URL (--upstream)")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"an inference server URL must start with http:// or https://, got {url!r}"
                )
        self.servers = [_Server(url.rstrip("/")) for url in urls]
        self.down_for_s = down_for_s
        self._sticky: dict[str, _Server] = {}
        # The connection pool itself, not an `httpx.AsyncClient` over it: a client's cookies,
        # redirects, auth, default headers and URL merging cost about a quarter of each call's
        # CPU in the gateway and serve nothing here (benchmarks/gateway.py). Nor does a pool read
        # proxy variables, so the environment cannot reroute calls to the configured servers.
        self.transport = httpx.AsyncHTTPTransport(
            # idle connections are let go after 2 s, before a server closes them (uvicorn, and
            # so vLLM's server, after 5 s): a request never races the server's close
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=2.0,
            ),
            trust_env=False,
        )
        self._timeout = {"timeout": httpx.Timeout(timeout_s, connect=connect_timeout_s).as_dict()}
        #: each server's URL for each path, parsed once rather than per call
        self._urls: dict[tuple[str, str], httpx.URL] = {}

    async def close(self) -> None:
        await self.transport.aclose()

    def _url(self, server: _Server, path: str) -> httpx.URL:
        url = self._urls.get((server.url, path))
        if url is None:
            url = self._urls[server.url, path] = httpx.URL(server.url + path)
        return url

    def _order(self, session_id: str) -> list[_Server]:
        """The servers to try for the session: its own first (while up), then the others."""
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        own = self._sticky.get(session_id)
        if own is None or own.down_until > now:
            candidates = up or self.servers
            own = min(candidates, key=lambda s: s.sessions)
            self._stick(session_id, own)
        return [own, *(s for s in up if s is not own)]

    def _stick(self, session_id: str, server: _Server) -> None:
        old = self._sticky.get(session_id)
        if old is not None:
            old.sessions -= 1
        server.sessions += 1
        self._sticky[session_id] = server

    def forget(self, session_id: str) -> None:
        """The session ended: it no longer counts on its server."""
        server = self._sticky.pop(session_id, None)
        if server is not None:
            server.sessions -= 1

    async def open(
        self, session_id: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[str, httpx.Response]:
        """Send the call and return (server, response with its body still to read); the caller
        closes the response. Raises `NoServerAnswered` when no server could be connected to."""
        errors: list[str] = []
        for server in self._order(session_id):
            request = httpx.Request(
                "POST",
                self._url(server, path),
                content=body,
                headers=headers,
                extensions=self._timeout,
            )
            try:
                response = await self.transport.handle_async_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                server.down_until = time.monotonic() + self.down_for_s
                errors.append(f"{server.url}: {type(error).__name__}: {error}")
                continue
            if self._sticky.get(session_id) is not server:
                self._stick(session_id, server)
            return server.url, response
        raise NoServerAnswered("; ".join(errors) or "no inference server is configured")
