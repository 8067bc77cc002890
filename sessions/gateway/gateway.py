"""The gateway: the ledger's sessions served to agents over an OpenAI-compatible HTTP endpoint.

`sessions.gateway.server.serve(ledger, upstreams)` runs one in the caller's event loop (the
ledger's); `gateway.session(...)` creates a session and yields its base URL and key for an agent;
the session ends when the block does (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from sessions.errors import InvalidInput
from sessions.gateway.keys import SessionKeys
from sessions.gateway.refusals import Refusal
from sessions.gateway.settings import GatewaySettings
from sessions.gateway.upstream import Upstreams
from sessions.vocabulary import INCOMPLETE_CAPTURE, INFRA, check_session_id

if TYPE_CHECKING:
    from sessions.gateway.agent import AgentExit
    from sessions.ledger import Ledger
    from sessions.recorder import SessionHandle

__all__ = ["Gateway", "GatewaySession", "LiveSession"]

T = TypeVar("T")


@dataclass(slots=True)
class LiveSession:
    """A session the gateway serves: its handle, the calls that made it untrainable, the order its
    calls settle in, and its last call for an agent's retry.

    A session's concurrent calls are settled (recorded or failed) in the order they started, so
    its log lists them as its agent made them (`rollout-ledger history`, the `model_calls` view).
    Rows are right either way (the ledger rebuilds prompts in record order); the requests still
    run side by side, only the appends wait their turn.
    """

    handle: SessionHandle
    untrainable: list[str] = field(default_factory=list)
    #: the key of the last call this process started and its answer once sent (None when the
    #: call failed): what an agent's retry of that call is answered with (`retries.py`)
    last_call: tuple[str, asyncio.Future[Any]] | None = None
    #: calls started by this process and not yet settled, by their number (`c<n>`)
    _unsettled: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    _starting: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def session_id(self) -> str:
        return self.handle.session_id

    async def start_call(self, sampling: dict[str, Any]) -> tuple[str, int]:
        """Record a call's intent; its id and number, its turn to settle reserved."""
        async with self._starting:  # the number is known before another call can start
            call_id = await self.handle.start_call(sampling=sampling)
            number = int(call_id[1:])
            self._unsettled[number] = asyncio.get_running_loop().create_future()
        return call_id, number

    async def turn(self, number: int) -> None:
        """Wait until the call started before `number` (by this process) has settled."""
        previous = self._unsettled.get(number - 1)
        if previous is not None:
            await asyncio.shield(previous)  # every path of a call settles it (forward.py)

    def settled(self, number: int) -> None:
        """Call `number` is recorded or failed (or never will be): the next may settle."""
        future = self._unsettled.pop(number, None)
        if future is not None and not future.done():
            future.set_result(None)

    async def finish(self, reason: str) -> str:
        """End the session as its calls allow: failed (`reason`, infra) when a call came without
        token ids, else `complete` (which fails closed on its own, design §15). Its state."""
        handle = self.handle
        if handle.terminal:
            return handle.state
        if self.untrainable:
            await handle.fail(
                reason,
                message="calls without token ids: " + "; ".join(self.untrainable)[:2000],
                error_type="MissingTokenIds",
                origin=INFRA,
            )
            return handle.state
        return await handle.complete()


class Gateway:
    """An OpenAI-compatible endpoint in front of `settings.upstreams` that records every call
    through `ledger`'s session handles: its sessions, keys and servers (the HTTP routes are
    `app.build_app(gateway)`; `server.serve` runs them)."""

    def __init__(self, ledger: Ledger, settings: GatewaySettings) -> None:
        self.ledger = ledger
        self.settings = settings
        self.keys = SessionKeys(settings.key)
        self.upstreams = Upstreams(
            settings.upstreams,
            timeout_s=settings.timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            down_for_s=settings.down_for_s,
        )
        self.base_url = ""
        #: the server's task while `server.serve` runs this gateway
        self.serving: asyncio.Future[Any] | None = None
        self._live: dict[str, LiveSession] = {}
        self._loading: dict[str, asyncio.Future[LiveSession]] = {}
        self._background: set[asyncio.Future[Any]] = set()

    # ------------------------------------------------------------------ serving
    async def wait(self) -> None:
        """Until the server stops (Ctrl-C or SIGTERM, which uvicorn turns into a graceful stop)."""
        if self.serving is not None:
            await asyncio.shield(self.serving)

    async def close(self) -> None:
        """Wait for settling work under way, then close the pooled client."""
        while self._background:
            await asyncio.wait(set(self._background))
        await self.upstreams.close()

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Run `work` in a task the gateway keeps until it ends (closing waits for it)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ----------------------------------------------------------------- sessions
    def session_base_url(self, session_id: str) -> str:
        """The base URL an agent of `session_id` is given (the OpenAI clients append `/chat/...`)."""
        return f"{self.base_url}/sessions/{quote(session_id, safe='')}/v1"

    async def create(self, session_id: str, **identity: Any) -> LiveSession:
        """Create a session (the ledger's `create_session` arguments) that agents reach here."""
        handle = await self.ledger.create_session(session_id, **identity)
        live = self._live[session_id] = LiveSession(handle)
        return live

    async def live(self, session_id: str) -> LiveSession:
        """The open session `session_id`, loaded from the log if this process does not hold it
        (after a restart); refused when it is unknown or has ended."""
        live = await self._held(session_id)
        if live.handle.terminal:
            self.forget(session_id)
            raise Refusal(
                409,
                "session_ended",
                f"session {session_id!r} has ended ({live.handle.state}); calls to it are refused "
                "and not recorded — start a new session",
            )
        return live

    async def _held(self, session_id: str) -> LiveSession:
        """`session_id` as this process holds it, loaded (and recovered) once if it does not."""
        live = self._live.get(session_id)
        if live is None:
            loading = self._loading.get(session_id)
            if loading is None:
                loading = self._loading[session_id] = asyncio.ensure_future(self._load(session_id))
                loading.add_done_callback(lambda _: self._loading.pop(session_id, None))
            live = await asyncio.shield(loading)
        return live

    async def _load(self, session_id: str) -> LiveSession:
        """Load a session this process did not start. Calls it left open were started by a gateway
        process that is gone (a session is served by one gateway at a time): their answers can
        never be recorded, so the session fails closed now rather than take more calls."""
        try:
            check_session_id(session_id)
            handle = await self.ledger.load_session(session_id)
        except InvalidInput:
            raise Refusal(
                404, "unknown_session", f"no session {session_id[:200]!r} in this ledger"
            ) from None
        lost = [] if handle.terminal else handle.view.open_calls()
        if lost:
            await handle.fail(
                INCOMPLETE_CAPTURE,
                message=f"call(s) {', '.join(lost)} were in flight when the gateway process "
                "serving them stopped: their answers are not in the log",
                error_type="GatewayRestarted",
                origin=INFRA,
            )
        live = LiveSession(handle)
        if not handle.terminal:
            live = self._live.setdefault(session_id, live)
        return live

    def forget(self, session_id: str) -> None:
        self._live.pop(session_id, None)
        self.upstreams.forget(session_id)

    async def end(
        self, session_id: str, *, fail_reason: str | None = None, message: str = ""
    ) -> str:
        """End a session: `fail_reason` given → failed with it; else completed as `finish` does.
        A session that has ended already (the gateway's recovery failed it) keeps its end: its
        state is the answer."""
        live = await self._held(session_id)
        try:
            if live.handle.terminal:
                return live.handle.state
            if fail_reason is not None:
                await live.handle.fail(fail_reason, message=message)
                return live.handle.state
            return await live.finish(self.settings.untrainable_reason)
        finally:
            self.forget(session_id)

    @contextlib.asynccontextmanager
    async def session(self, session_id: str, **identity: Any) -> AsyncIterator[GatewaySession]:
        """A session for one agent, as `Ledger.session`: the block's normal end finishes it
        (completed, or failed when a call had no token ids), an exception fails it, a
        cancellation cancels it. Yields its `base_url` and `api_key`."""
        async with self.ledger.session(session_id, **identity) as handle:
            live = self._live[session_id] = LiveSession(handle)
            try:
                yield GatewaySession(self, live)
                await live.finish(self.settings.untrainable_reason)
            finally:
                self.forget(session_id)


@dataclass(slots=True)
class GatewaySession:
    """What the training side holds of one gateway session."""

    gateway: Gateway
    live: LiveSession

    @property
    def session_id(self) -> str:
        return self.live.session_id

    @property
    def handle(self) -> SessionHandle:
        return self.live.handle

    @property
    def base_url(self) -> str:
        return self.gateway.session_base_url(self.session_id)

    @property
    def api_key(self) -> str:
        return self.gateway.keys.key_for(self.session_id)

    def environment(self) -> dict[str, str]:
        """The variables the OpenAI clients read: `OPENAI_BASE_URL`, `OPENAI_API_KEY`."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key}

    async def post_reward(self, reward: float | None, **info: Any) -> None:
        await self.live.handle.post_reward(reward, **info)

    async def run_agent(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> AgentExit:
        """Run the agent process with this session's base URL and key; a non-zero exit, a
        signal, a failure to start or `timeout` fails the session (its calls kept)."""
        from sessions.gateway.agent import run_agent

        return await run_agent(
            self.handle, self.environment(), argv, timeout=timeout, env=env, cwd=cwd
        )
