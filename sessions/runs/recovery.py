"""Recovery sweep: fail sessions left open by a dead process, so no group stays unsettled.

A trainer waiting on a step whose prompt never leaves `running` hangs forever (verl #7155,
uni-agent #81). The sweep finds sessions whose last event is older than a threshold and fails
them with reason `orphaned` (placeholder per policy), which settles their groups.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from sessions.errors import ConcurrencyError, InvalidArgument, InvalidTransition
from sessions.runs.parts import LedgerParts
from sessions.vocabulary import ORPHANED
from store import read_models as rm

__all__ = [
    "fail_orphaned",
    "parse_duration",
    "recover",
]


#: Orphans failed at once (each a read and an append; the appends share group commits).
_RECOVER_CONCURRENCY = 64


def parse_duration(text: str) -> timedelta:
    """'90s', '15m', '2h', '1d' (or plain seconds) -> timedelta."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            seconds = float(text[:-1]) * units[text[-1]]
        else:
            seconds = float(text)
    except ValueError:
        raise InvalidArgument(
            f"duration {text!r}: use a number with s, m, h or d, e.g. 30m"
        ) from None
    if not seconds >= 0 or seconds == float("inf"):  # also rejects nan
        raise InvalidArgument(f"duration {text!r}: must be a finite number >= 0, e.g. 30m")
    return timedelta(seconds=seconds)


async def recover(
    ledger: LedgerParts, older_than: timedelta, *, run: str | None = None
) -> list[str]:
    """Fail every open session idle for longer than `older_than`; returns their ids."""
    if older_than < timedelta(0):
        raise InvalidArgument(
            f"older_than must not be negative, got {older_than}; a negative age would fail live sessions"
        )
    await ledger.project()
    cutoff = datetime.now(timezone.utc) - older_than
    async with ledger.engine.connect() as conn:
        candidates = await rm.open_sessions_last_event(conn, run=run)
    return await fail_orphaned(
        ledger,
        {
            session_id: f"no event since {last.isoformat()}; failed by the recovery sweep"
            for session_id, last in candidates
            if last < cutoff
        },
    )


async def fail_orphaned(ledger: LedgerParts, messages: dict[str, str]) -> list[str]:
    """Fail each session named as `orphaned` with its message, unless it ended meanwhile; returns
    the ids failed here. The recovery sweep and a new launch (`sessions.runs.launches`) use it."""
    limit = asyncio.Semaphore(_RECOVER_CONCURRENCY)

    async def fail(session_id: str, message: str) -> str | None:
        async with limit:
            handle = await ledger.load_session(session_id)
            if handle.terminal:
                return None
            try:
                await handle.fail(ORPHANED, message=message)
            except (ConcurrencyError, InvalidTransition):
                return None  # its owner was alive after all and moved it on
            return session_id

    # Concurrently, so the event store commits the failures in a few group commits, not one each.
    done = await asyncio.gather(*(fail(sid, message) for sid, message in messages.items()))
    return [session_id for session_id in done if session_id is not None]
