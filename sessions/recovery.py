"""Recovery sweep: fail sessions left open by a dead process, so no group stays unsettled.

A trainer waiting on a step whose prompt never leaves `running` hangs forever (verl #7155,
uni-agent #81). The sweep finds sessions whose last event is older than a threshold and fails
them with reason `orphaned` (placeholder per policy), which settles their groups.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from sessions.errors import ConcurrencyError, InvalidTransition
from store.tables import events, sessions

if TYPE_CHECKING:
    from sessions.ledger import Ledger


def parse_duration(text: str) -> timedelta:
    """'90s', '15m', '2h', '1d' (or plain seconds) -> timedelta."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return timedelta(seconds=float(text[:-1]) * units[text[-1]])
        return timedelta(seconds=float(text))
    except ValueError:
        raise ValueError(f"duration {text!r}: use a number with s, m, h or d, e.g. 30m") from None


async def recover(ledger: Ledger, older_than: timedelta, *, run: str | None = None) -> list[str]:
    """Fail every open session idle for longer than `older_than`; returns their ids."""
    await ledger.project()
    cutoff = datetime.now(timezone.utc) - older_than
    query = (
        select(sessions.c.session_id, func.max(events.c.recorded_at))
        .join(events, events.c.session_id == sessions.c.session_id)
        .where(sessions.c.state.in_(("created", "running")))
        .group_by(sessions.c.session_id)
    )
    if run is not None:
        query = query.where(sessions.c.run == run)
    async with ledger.engine.connect() as conn:
        candidates = [(sid, last) for sid, last in await conn.execute(query)]
    failed = []
    for session_id, last in candidates:
        if last.tzinfo is None:
            last = last.replace(tzinfo=timezone.utc)
        if last >= cutoff:
            continue
        handle = await ledger.load_session(session_id)
        if handle.terminal:
            continue
        try:
            await handle.fail("orphaned", message=f"no event since {last.isoformat()}; failed by the recovery sweep")
        except (ConcurrencyError, InvalidTransition):
            continue  # its owner was alive after all and moved it on
        failed.append(session_id)
    return failed
