"""What a run job (`prune`, `recover`) needs of a ledger, as a protocol: its database, its event
store, its run, projecting the log, and a handle on a stored session. A `Ledger` is one; the jobs
sit below the facade that builds on them, so they name these parts and never import it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sessions.recorder import SessionHandle
    from store import AsyncEngine, EventStore


@runtime_checkable
class LedgerParts(Protocol):
    """The ledger's parts a run job uses (`sessions.Ledger` has every one)."""

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def store(self) -> EventStore: ...

    @property
    def run(self) -> str: ...

    async def project(self) -> int:
        """Project the log to its end."""
        ...

    async def load_session(self, session_id: str) -> SessionHandle:
        """A handle on a stored session, folded from its events."""
        ...
