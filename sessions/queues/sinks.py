"""Queue sinks the projector writes to, behind one small interface.

The durable queue table (`queue_rows`) is always written, in the projector's transaction. Sinks
here are *external* to that transaction: they are written before the checkpoint commits, with
deterministic keys, so delivery is at-least-once and idempotent by key (docs/design.md §7).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sessions.batches import BatchRow

__all__ = [
    "InProcessQueue",
    "QueueItem",
    "QueueSink",
]


@dataclass(frozen=True, slots=True)
class QueueItem:
    """One queue entry: a trajectory/placeholder row (`row` set) or a group tag (`row` None)."""

    run: str
    partition: str
    global_step: int | None
    key: str
    uid: str
    tags: dict[str, Any]
    row: BatchRow | None = field(default=None, repr=False)

    @property
    def is_tag(self) -> bool:
        return self.row is None


@runtime_checkable
class QueueSink(Protocol):
    async def put(self, items: Sequence[QueueItem]) -> None:
        """Store the items; re-putting a key replaces it (idempotent by key)."""


class InProcessQueue:
    """A queue in this process's memory, for a training loop that embeds the ledger.

    Entries are kept per (run, partition) in put order; a re-put key replaces its entry in place.
    Tag entries merge like TransferQueue's tags (`dict.update`).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], OrderedDict[str, QueueItem]] = {}
        self._changed = asyncio.Condition()

    async def put(self, items: Sequence[QueueItem]) -> None:
        for item in items:
            entries = self._entries.setdefault((item.run, item.partition), OrderedDict())
            previous = entries.get(item.key)
            if previous is not None and item.is_tag:
                item = QueueItem(
                    item.run,
                    item.partition,
                    item.global_step,
                    item.key,
                    item.uid,
                    {**previous.tags, **item.tags},
                )
            entries[item.key] = item
        async with self._changed:
            self._changed.notify_all()

    def items(
        self, run: str, partition: str, global_step: int | None = None, *, tags: bool = False
    ) -> list[QueueItem]:
        entries = self._entries.get((run, partition), OrderedDict())
        return [
            item
            for item in entries.values()
            if item.is_tag == tags and (global_step is None or item.global_step == global_step)
        ]

    def rows(self, run: str, partition: str, global_step: int | None = None) -> list[BatchRow]:
        return [
            item.row for item in self.items(run, partition, global_step) if item.row is not None
        ]

    def tag(self, run: str, partition: str, uid: str) -> dict[str, Any] | None:
        item = self._entries.get((run, partition), OrderedDict()).get(uid)
        return None if item is None else dict(item.tags)

    def clear(self, run: str, partition: str, global_step: int | None = None) -> int:
        """Drop a consumed step's entries (all of the partition with global_step None)."""
        entries = self._entries.get((run, partition))
        if not entries:
            return 0
        doomed = [
            k
            for k, item in entries.items()
            if global_step is None or item.global_step == global_step
        ]
        for key in doomed:
            del entries[key]
        return len(doomed)

    async def wait_for_change(self, timeout: float | None = None) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except asyncio.TimeoutError:
                return False
        return True
