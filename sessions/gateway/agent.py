"""An agent process run against one gateway session: its exit decides a failure.

The agent gets the session's `OPENAI_BASE_URL` and `OPENAI_API_KEY` and nothing else changes;
a non-zero exit, a signal, a failure to start or a timeout fails the session — its recorded
calls stay in the log and its row in the batch is the placeholder. A clean exit leaves the
session open for the training side to post a reward and end it (the helper's block does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sessions.vocabulary import RUNNER_ERROR, TIMEOUT

if TYPE_CHECKING:
    from sessions.recorder import SessionHandle

__all__ = ["AgentExit", "run_agent"]

#: How much of the agent's stderr a failure's message keeps (its end: where the error is).
STDERR_TAIL = 2000


@dataclass(frozen=True, slots=True)
class AgentExit:
    """How the agent process ended. `returncode`: its status (negative: the signal that ended it;
    None: it never started); `timed_out`: killed at its timeout."""

    returncode: int | None
    timed_out: bool
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def failure(self, timeout: float | None) -> tuple[str, str] | None:
        """(reason, message) the session fails with, or None for a clean exit."""
        tail = f": {self.stderr_tail}" if self.stderr_tail else ""
        if self.timed_out:
            return TIMEOUT, f"the agent ran past its {timeout:g}s timeout and was killed{tail}"
        if self.returncode is None:
            return RUNNER_ERROR, f"the agent could not start{tail}"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return RUNNER_ERROR, f"the agent was killed by {name}{tail}"
        if self.returncode:
            return RUNNER_ERROR, f"the agent exited with status {self.returncode}{tail}"
        return None


async def run_agent(
    handle: SessionHandle,
    session_environment: dict[str, str],
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> AgentExit:
    """Run `argv` as the agent of `handle`'s session, with the session's variables
    (`session_environment`) over the process's and `env` (see the module); its exit."""
    environment = {**os.environ, **(env or {}), **session_environment}
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=environment,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as error:
        result = AgentExit(None, False, f"{type(error).__name__}: {error}")
    else:
        timed_out = False
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            _, stderr = await process.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        tail = stderr.decode(errors="replace").strip()[-STDERR_TAIL:]
        result = AgentExit(process.returncode, timed_out, tail)
    failure = result.failure(timeout)
    if failure is not None and not handle.terminal:
        reason, message = failure
        await handle.fail(reason, message=message, error_type="AgentExit")
    return result
