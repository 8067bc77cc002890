"""A run's launches: each start of a job that writes to the run, and each resume after a crash.

Large runs crash and restart from a checkpoint, re-running step k with new uids under the same
run. Without a record of the launches the ledger cannot tell the dead launch's sessions from the
new one's: the trainer waits on a session nobody will end, or mixes both launches in its figures.

A launch is named by a string every process of one job knows alike without talking to the others
(docs/design.md §14): `LedgerConfig(launch=...)`, else the environment variable
`ROLLOUT_LEDGER_LAUNCH` the job's launcher sets for all its processes, else what an integration
derives (verl: the Ray job; TRL: the rank-0 token it broadcasts). Without one, a ledger records
no launches and supersedes nothing, as before launches existed.

The first process of a launch to write to the run appends `RunLaunched(launch, number)` to the
run's own stream (numbers 1, 2, ... in the stream's order; a race between two processes is
settled by the stream's expected version), and fails at once, as `orphaned`, the sessions of
earlier launches that are still open (`fail_orphans`). Every session a ledger creates carries its
launch's number (`SessionCreated.launch`); the projection rules count a step on the sessions of
the latest launch that created one there (`sessions.projection.rules`), and the reads behind
`batch` and the settled wait take that launch's groups only (`store.read_models.queries`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sessions import events as ev
from sessions import storable
from sessions.errors import ConfigError, LedgerError
from sessions.runs.fingerprint import run_envelope, run_stream
from sessions.runs.parts import LedgerParts
from sessions.runs.recovery import fail_orphaned
from store import AsyncEngine, ConcurrencyError, EventStore
from store import read_models as rm

__all__ = [
    "LAUNCH_ENV",
    "Launch",
    "check_launch",
    "ensure_launched",
    "fail_orphans",
    "launch_from_environment",
]

#: The environment variable a job's launcher sets, the same in every process of the job.
LAUNCH_ENV = "ROLLOUT_LEDGER_LAUNCH"
#: A launch id is stored in the run's stream; as long as a session id at most.
_LAUNCH_LIMIT = 128
#: Tries to record a launch while other processes append to the run's stream.
_RACES = 8


@dataclass(frozen=True, slots=True)
class Launch:
    """A launch as recorded: its id, its number in the run, and whether this call recorded it."""

    launch: str
    number: int
    recorded: bool
    resumed: bool


def check_launch(value: object, where: str = "launch") -> str | None:
    """None, or a launch id: a non-empty printable string of at most 128 characters."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _LAUNCH_LIMIT
        or not value.isprintable()
    ):
        raise ConfigError(
            f"{where} must be None or a non-empty printable string of at most {_LAUNCH_LIMIT} "
            f"characters naming this launch of the job (the same in all its processes), got {value!r:.80}",
            argument="launch",
        )
    return value


def launch_from_environment() -> str | None:
    """`ROLLOUT_LEDGER_LAUNCH`, checked, or None when it is unset or empty."""
    return check_launch(os.environ.get(LAUNCH_ENV) or None, where=f"${LAUNCH_ENV}")


async def ensure_launched(store: EventStore, engine: AsyncEngine, run: str, launch: str) -> Launch:
    """The run's record of `launch`: read back if a process of the launch recorded it, else
    appended as the run's next launch (`resumed` when the run has sessions already)."""
    stream = run_stream(run)
    for _ in range(_RACES):
        stored = await store.read_stream(stream)
        launches = [
            e for e in (ev.decode(s).event for s in stored) if isinstance(e, ev.RunLaunched)
        ]
        for known in launches:
            if known.launch == launch:
                return Launch(launch, known.number, False, known.resumed)
        async with engine.connect() as conn:
            last_steps = await rm.run_last_steps(conn, run)
        number = len(launches) + 1
        event = storable.clean_event(
            stream,
            ev.RunLaunched(
                launch=launch, number=number, resumed=bool(last_steps), last_steps=last_steps
            ),
        )
        try:
            await store.submit(
                stream, len(stored), [run_envelope(event, run, version=len(stored) + 1)]
            )
        except ConcurrencyError:
            continue  # another process appended to the run's stream first: read it again
        return Launch(launch, number, True, bool(last_steps))
    raise LedgerError(
        f"run {run!r}: could not record launch {launch!r} (other processes kept appending to the "
        "run's stream); open the ledger again"
    )


async def fail_orphans(parts: LedgerParts, run: str, launch: Launch) -> list[str]:
    """Fail, as `orphaned`, every session of `run` an earlier launch left open (projected first);
    returns their ids. Their groups settle, and a step the new launch re-runs counts its own
    sessions only whether or not this ran."""
    await parts.project()
    async with parts.engine.connect() as conn:
        left_open = await rm.open_sessions_before_launch(conn, run, launch.number)
    message = (
        f"left open by an earlier launch of run {run!r}; failed when launch {launch.launch!r} "
        f"(number {launch.number}) started"
    )
    return await fail_orphaned(parts, dict.fromkeys(left_open, message))
