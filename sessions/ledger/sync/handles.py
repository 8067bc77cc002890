"""A session's faces for a `SyncLedger`: `SyncSession` (blocking) and `SessionProxy` (awaitable
from any event loop). Each command runs on the ledger's loop, on the `SessionHandle` there."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from sessions.recorder import SessionHandle

if TYPE_CHECKING:
    from sessions.aggregate import SessionView
    from sessions.ledger.sync.ledger import SyncLedger

__all__ = ["SessionProxy", "SyncSession"]


def _command(handle: SessionHandle, name: str, given: dict[str, Any]) -> Coroutine[Any, Any, Any]:
    """`handle.<name>(...)` with the face's arguments, taken from the face's own locals by the
    command's parameter names (a `**info` spread as keywords): each face keeps its typed
    signature (tests/ledger/test_faces.py holds them equal) without a third copy of every keyword list."""
    arguments: dict[str, Any] = {}
    for parameter in _parameters(name):
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(given[parameter.name])
        else:
            arguments[parameter.name] = given[parameter.name]
    return getattr(handle, name)(**arguments)


@functools.cache
def _parameters(name: str) -> tuple[inspect.Parameter, ...]:
    signature = inspect.signature(getattr(SessionHandle, name))
    return tuple(p for p in signature.parameters.values() if p.name != "self")


class _Session:
    """What both session faces share: the handle (on the ledger's loop) and its read-only state."""

    def __init__(self, owner: SyncLedger, handle: SessionHandle) -> None:
        self._owner = owner
        self._handle = handle

    @property
    def session_id(self) -> str:
        return self._handle.session_id

    @property
    def state(self) -> str:
        return self._handle.state

    @property
    def version(self) -> int:
        return self._handle.version

    @property
    def terminal(self) -> bool:
        return self._handle.terminal

    @property
    def attempt(self) -> int:
        """The current attempt, 1-based (a runner may behave differently on a retry)."""
        return self._handle.attempt

    @property
    def view(self) -> SessionView:
        """The folded state (read-only by convention)."""
        return self._handle.view

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.session_id!r}, state={self.state!r})"


class SyncSession(_Session):
    """A session's commands as blocking calls (see `SessionHandle` for each command)."""

    def start(self, *, attempt: int | None = None, timeout_s: float | None = None) -> None:
        self._owner._call(_command(self._handle, "start", locals()), "start")

    def record_trajectory(
        self,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_mask: Any | None = None,
        response_logprobs: Any | None = None,
        num_turns: int = 1,
        materialization_reason: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int:
        recording = _command(self._handle, "record_trajectory", locals())
        return self._owner._call(recording, "record_trajectory")

    def post_reward(self, reward: float | None, **info: Any) -> None:
        self._owner._call(_command(self._handle, "post_reward", locals()), "post_reward")

    def complete(
        self, *, score: float | None = None, trajectory_selection: str | None = None
    ) -> str:
        completing = _command(self._handle, "complete", locals())
        return self._owner._call(completing, "complete")

    def fail(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
    ) -> None:
        failing = _command(self._handle, "fail", locals())
        self._owner._call(failing, "fail")

    def fail_with(self, error: BaseException) -> None:
        self._owner._call(_command(self._handle, "fail_with", locals()), "fail_with")

    def retry(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_in_s: float = 0.0,
    ) -> None:
        retrying = _command(self._handle, "retry", locals())
        self._owner._call(retrying, "retry")

    def retry_with(self, error: BaseException, *, retry_in_s: float = 0.0) -> None:
        self._owner._call(_command(self._handle, "retry_with", locals()), "retry_with")

    def cancel(self, message: str | None = None) -> None:
        self._owner._call(_command(self._handle, "cancel", locals()), "cancel")


class SessionProxy(_Session):
    """A session's commands, awaitable from any event loop (each runs on the ledger's loop)."""

    async def start(self, *, attempt: int | None = None, timeout_s: float | None = None) -> None:
        await self._owner._hop(_command(self._handle, "start", locals()), "start")

    async def record_trajectory(
        self,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_mask: Any | None = None,
        response_logprobs: Any | None = None,
        num_turns: int = 1,
        materialization_reason: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int:
        recording = _command(self._handle, "record_trajectory", locals())
        return await self._owner._hop(recording, "record_trajectory")

    async def post_reward(self, reward: float | None, **info: Any) -> None:
        await self._owner._hop(_command(self._handle, "post_reward", locals()), "post_reward")

    async def complete(
        self, *, score: float | None = None, trajectory_selection: str | None = None
    ) -> str:
        completing = _command(self._handle, "complete", locals())
        return await self._owner._hop(completing, "complete")

    async def fail(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
    ) -> None:
        failing = _command(self._handle, "fail", locals())
        await self._owner._hop(failing, "fail")

    async def fail_with(self, error: BaseException) -> None:
        await self._owner._hop(_command(self._handle, "fail_with", locals()), "fail_with")

    async def retry(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_in_s: float = 0.0,
    ) -> None:
        retrying = _command(self._handle, "retry", locals())
        await self._owner._hop(retrying, "retry")

    async def retry_with(self, error: BaseException, *, retry_in_s: float = 0.0) -> None:
        await self._owner._hop(_command(self._handle, "retry_with", locals()), "retry_with")

    async def cancel(self, message: str | None = None) -> None:
        await self._owner._hop(_command(self._handle, "cancel", locals()), "cancel")
