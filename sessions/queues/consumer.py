"""`QueueConsumer`: one named consumer of the durable queue table (docs/design.md §7).

Several consumers (tasks, processes, hosts) may share one queue: each claimed row goes to
exactly one of them, and rows a consumer claimed but never acked come back after its lease,
so a crashed trainer worker does not lose data. The SQL lives in `store.queue_claims`; this
class adds the domain side: turning claimed rows into a padded training batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Protocol

from sessions import vocabulary
from sessions.errors import InvalidArgumentType
from store import AsyncEngine
from store import queue_claims as qc
from store import read_models as rm

if TYPE_CHECKING:
    from tensordict import TensorDict


class _HasEngine(Protocol):
    """What a consumer needs of a ledger: the engine of its database (a `Ledger` has one). A
    protocol, so this module need not import the ledger that builds on it."""

    @property
    def engine(self) -> AsyncEngine: ...


class QueueConsumer:
    """Claims rows of one (run, partition) for the consumer `name`; ack what you have used.

    Give each live consumer its own name: a claim belongs to a name, so two workers sharing a
    name could ack each other's rows. A restarted worker may reuse its old name.
    """

    def __init__(
        self,
        ledger_or_engine: _HasEngine | AsyncEngine,
        name: str,
        *,
        run: str,
        partition: str,
        lease_seconds: float = 300.0,
    ) -> None:
        engine = (
            ledger_or_engine
            if isinstance(ledger_or_engine, AsyncEngine)
            else getattr(ledger_or_engine, "engine", None)
        )
        if not isinstance(engine, AsyncEngine):
            raise InvalidArgumentType(
                f"QueueConsumer needs a Ledger or an AsyncEngine, got {type(ledger_or_engine).__name__}"
            )
        vocabulary.check_run(run)
        vocabulary.check_partition(partition)
        qc.check_consumer(name)
        qc.check_claim_args(run, 1, ..., lease_seconds)
        self.engine = engine
        self.name = name
        self.run = run
        self.partition = partition
        self.lease_seconds = float(lease_seconds)

    def __repr__(self) -> str:
        return f"QueueConsumer({self.name!r}, run={self.run!r}, partition={self.partition!r})"

    async def claim_rows(
        self, limit: int, global_step: int | None | EllipsisType = ...
    ) -> list[dict[str, Any]]:
        """Claim up to `limit` queue rows (dicts, `id` order); empty when none are available."""
        return await qc.claim(
            self.engine,
            self.name,
            run=self.run,
            partition=self.partition,
            limit=limit,
            global_step=global_step,
            lease_seconds=self.lease_seconds,
        )

    async def claim_batch(
        self, limit: int, global_step: int | None | EllipsisType = ..., **build_padded_kwargs: Any
    ) -> tuple[TensorDict | None, list[int]]:
        """Claim up to `limit` rows and build them into a padded batch (`build_padded`).

        Returns (batch, row ids to ack); (None, []) when nothing was available. If building the
        batch fails (e.g. a row too long without `truncate=True`) the rows are released before
        the error propagates, so they are not held hostage for a whole lease.
        """
        rows = await self.claim_rows(limit, global_step)
        if not rows:
            return None, []
        ids = [int(row["id"]) for row in rows]
        try:
            from sessions.batches import build_padded  # torch: imported only when a batch is built
            from sessions.batches.rows import materialise

            async with self.engine.connect() as conn:
                sources = await rm.source_events(conn, [row["source_position"] for row in rows])
            batch = build_padded(materialise(rows, sources), **build_padded_kwargs)
        except BaseException:
            await qc.release(self.engine, self.name, ids)
            raise
        return batch, ids

    async def ack(self, ids: Sequence[int]) -> int:
        """Mark rows consumed; returns how many were still ours to ack (see `store.queue_claims.ack`)."""
        return await qc.ack(self.engine, self.name, ids)

    async def release(self, ids: Sequence[int]) -> int:
        """Hand unacked rows back to the queue now rather than after the lease."""
        return await qc.release(self.engine, self.name, ids)


__all__ = ["QueueConsumer"]
