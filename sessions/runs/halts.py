"""A run's circuit breaker as a ledger runs it: the fold (`sessions.runs.breaker`) over the run's
session ends in log order, read from the log's tail since the last look, and the trip recorded
as `BreakerTripped` in the run's stream (docs/failures.md "The circuit breaker").

Every ledger of the run reads the same log in the same order (appends become visible in position
order on both databases), so each one's fold is the same fold: the first to see a trip records
it, the others read it back. A ledger looks before it creates a session (at most every
`interval` seconds, so the look costs the hot path nothing it would notice) and before and after
it waits for a step's batch or metrics (always); after a failure of one of its own sessions
(`look_soon`) the next creation looks whatever the interval, so a run in one process halts at
exactly the session after the trip. The fold starts at the run's last launch: a
launch re-arms a halted run. The rule is the one the run's configuration recorded
(`RunConfigured.config["breaker"]`), never the reading ledger's own settings: a replay or a
reader with other settings halts where the run did.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from sessions import events as ev
from sessions import storable
from sessions.errors import ConcurrencyError, RunHalted
from sessions.runs.breaker import (
    CANCELLED,
    FAILED,
    SUCCEEDED,
    BreakerFold,
    CircuitBreaker,
    Outcome,
    describe,
)
from sessions.runs.fingerprint import run_envelope, run_stream
from store import AsyncEngine, EventStore, retry_transient
from store import read_models as rm

__all__ = ["RunWatch", "outcome_of"]

_KINDS = {"SessionSucceeded": SUCCEEDED, "SessionFailed": FAILED, "SessionCancelled": CANCELLED}
_READ = (*_KINDS, "RunLaunched", "BreakerTripped")
_PAGE = 5000


def outcome_of(position: int, session_id: str, type_: str, data: dict[str, Any]) -> Outcome:
    """A terminal event as the fold reads it."""
    return Outcome(
        position=position,
        kind=_KINDS[type_],
        session_id=session_id,
        reason=data.get("reason"),
        origin=data.get("origin"),
        message=str(data.get("message") or ""),
    )


class RunWatch:
    """One run's breaker, kept by one ledger: `check` raises `RunHalted` once the run is halted."""

    def __init__(
        self, store: EventStore, engine: AsyncEngine, run: str, *, interval: float = 0.5
    ) -> None:
        self._store, self._engine, self.run = store, engine, run
        self._interval = interval
        #: the run's recorded rule (None: the run has none, or is not recorded yet)
        self.breaker: CircuitBreaker | None = None
        self._fold: BreakerFold | None = None
        self._position: int | None = None  # the log position read up to (None: not started)
        self._looked = float("-inf")
        #: the run's recorded halt since its last launch, if any
        self.halted: ev.BreakerTripped | None = None
        self._unrecorded: ev.BreakerTripped | None = None
        #: the look in flight: callers that arrive meanwhile wait for its answer instead of
        #: passing the interval's gate while it reads (a step's creations come all at once)
        self._look: asyncio.Future[None] | None = None

    def look_soon(self) -> None:
        """A session of this ledger failed: the next `check` reads the log."""
        self._looked = float("-inf")

    async def check(self, *, now: bool = False) -> None:
        """Read the run's session ends since the last look (unless one was less than `interval`
        ago and `now` is False), record a trip, and raise `RunHalted` if the run is halted."""
        look = self._look
        if look is None:
            if self.halted is None and not now and time.monotonic() - self._looked < self._interval:
                return
            look = self._look = asyncio.ensure_future(self._read())
            look.add_done_callback(self._looked_once)
        await asyncio.shield(look)
        if self.halted is not None:
            raise RunHalted(
                self.run, self.halted.rule, self.halted.tripped_at, describe(self.halted)
            )

    def _looked_once(self, look: asyncio.Future[None]) -> None:
        if self._look is look:
            self._look = None
        if not look.cancelled():
            look.exception()  # retrieved here: every waiter has it raised, none left unread

    async def _read(self) -> None:
        """One look: the run's ends since the last, folded; a trip recorded."""
        self._looked = time.monotonic()
        if self._position is None:
            self._position = await self._start()
        if self._fold is None:
            return  # the run records no breaker (or no configuration yet: looked at again later)
        while True:
            page = await retry_transient(self._page, what="the circuit breaker's look at the log")
            for position, session_id, type_, data in page:
                self._position = position
                self._observe(position, session_id, type_, json.loads(data))
            if len(page) < _PAGE:
                break
        if self._unrecorded is not None and self.halted is None:
            await self._record(self._unrecorded)

    async def _page(self) -> list[tuple[int, str, str, str]]:
        assert self._position is not None
        async with self._engine.connect() as conn:
            return await rm.run_ends_after(conn, self.run, _READ, self._position, _PAGE)

    def _observe(self, position: int, session_id: str, type_: str, data: dict[str, Any]) -> None:
        assert self._fold is not None
        if type_ == "RunLaunched":
            self._fold.relaunch()
            self.halted, self._unrecorded = None, None
        elif type_ == "BreakerTripped":
            self.halted = ev.BreakerTripped(**_fields(data))
            self._unrecorded = None
            self._fold.halted = True
        else:
            trip = self._fold.observe(outcome_of(position, session_id, type_, data))
            if trip is not None and self.halted is None:
                self._unrecorded = trip

    async def _start(self) -> int | None:
        """The run's recorded rule, and where the fold starts: just before the run's last launch,
        else its first record (None, and no fold, while the run has no configuration)."""
        stored = await self._store.read_stream(run_stream(self.run))
        configs = [s for s in stored if s.type == "RunConfigured"]
        if not configs:
            return None
        config = ev.decode(configs[-1]).event.config  # type: ignore[attr-defined]
        self.breaker = CircuitBreaker.from_config(config.get("breaker"))
        self._fold = None if self.breaker is None else BreakerFold(self.breaker)
        launches = [s.position for s in stored if s.type == "RunLaunched"]
        return (launches[-1] if launches else stored[0].position) - 1

    async def _record(self, trip: ev.BreakerTripped) -> None:
        """Append the trip to the run's stream, once: a ledger that loses the race reads the
        winner's record back on its next look."""
        stream = run_stream(self.run)
        stored = await self._store.read_stream(stream)
        recorded = [ev.decode(s).event for s in stored]
        if any(
            isinstance(e, ev.BreakerTripped) and e.tripped_at == trip.tripped_at for e in recorded
        ):
            return
        event = storable.clean_event(stream, trip)
        try:
            await self._store.submit(
                stream, len(stored), [run_envelope(event, self.run, version=len(stored) + 1)]
            )
        except ConcurrencyError:
            pass  # another writer appended to the run's stream: the next look reads it
        self.halted = event  # type: ignore[assignment]
        self._unrecorded = None


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    names = set(ev.BreakerTripped.__dataclass_fields__)  # type: ignore[attr-defined]
    return {key: value for key, value in data.items() if key in names}
