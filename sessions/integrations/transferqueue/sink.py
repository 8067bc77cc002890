"""``TransferQueueSink``: the projector's rows and group tags, put into TransferQueue.

Writes are idempotent by key: a re-projected row replaces the stored one. A failed or timed-out
put raises ``TransferQueueSinkError``; the projector calls sinks inside its page transaction, so
the page rolls back, the checkpoint stays, and the page is put again on the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sessions.errors import ConfigError, LedgerError
from sessions.integrations.transferqueue.fields import _row_tags, rows_to_tensordict
from sessions.integrations.transferqueue.readback import aread_rows, read_rows
from sessions.integrations.transferqueue.runtime import import_transfer_queue
from sessions.queues.sinks import QueueItem

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["TransferQueueSink", "TransferQueueSinkError", "TransferQueueTimeout"]


class TransferQueueSinkError(LedgerError, RuntimeError):
    """A TransferQueue put failed; the projector's page rolls back and its checkpoint stays."""


class TransferQueueTimeout(TransferQueueSinkError, TimeoutError):
    """A TransferQueue put did not finish within the sink's ``timeout_s``."""


@dataclass
class _PartitionWork:
    rows: dict[str, QueueItem] = field(default_factory=dict)  # key -> last item for that key
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> merged tag


class TransferQueueSink:
    """A ``QueueSink`` writing to the TransferQueue this process is connected to.

    Connect first (``transfer_queue.init()`` in a process of the Ray cluster that runs it, or
    ``start_transferqueue()``); the sink uses TransferQueue's module-level client.

    ``timeout_s`` bounds one ``put`` (all its round trips). On SQLite the projector holds the
    database's write lock while sinks run, and writers wait up to 30 s for it, so keep the timeout
    well below that. ``partition_ids`` maps the ledger's partitions to TransferQueue partition ids
    (default: the same names, ``train`` and ``val``). ``write_log_probs``: True writes
    ``rollout_log_probs`` on every row (zeros where a row has none), so that rows with and without
    logprobs can be read back together (TransferQueue refuses to read a field some keys lack);
    False never writes it. ``max_rows_per_put`` bounds one message. ``isolate_placeholders``
    (None: on for ``train``, off for ``val``) writes a placeholder row's ``uid`` field as
    ``{uid}-ph{session_index}``, so verl V1's stock GRPO keeps it out of its group's baseline;
    ``group_uid`` always holds the prompt's uid.
    """

    def __init__(
        self,
        *,
        timeout_s: float | None = 20.0,
        partition_ids: Mapping[str, str] | None = None,
        write_log_probs: bool = True,
        max_rows_per_put: int = 256,
        isolate_placeholders: bool | None = None,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive or None, got {timeout_s!r}")
        if max_rows_per_put < 1:
            raise ConfigError(f"max_rows_per_put must be >= 1, got {max_rows_per_put!r}")
        self.timeout_s = timeout_s
        self.partition_ids = dict(partition_ids or {})
        self.write_log_probs = write_log_probs
        self.max_rows_per_put = max_rows_per_put
        self.isolate_placeholders = isolate_placeholders
        self._tq = import_transfer_queue()
        self.rows_put = 0
        self.tags_put = 0

    def partition_id(self, partition: str) -> str:
        return self.partition_ids.get(partition, partition)

    async def put(self, items: Sequence[QueueItem]) -> None:
        """Put the page's rows, then its group tags; raise ``TransferQueueSinkError`` on any failure.

        Every row of the page is put before any group tag, which keeps each tag after its own
        group's rows (the order the projector gives): one round trip per partition and
        ``max_rows_per_put`` rows, then one per partition for the tags.
        A key given twice keeps its last row; tags given twice for one key merge in order.
        """
        if not items:
            return
        work = self._plan(items)
        n_rows = sum(len(w.rows) for w in work.values())
        n_tags = sum(len(w.tags) for w in work.values())
        what = f"{n_rows} rows and {n_tags} group tags to partitions {sorted(work)}"
        try:
            if self.timeout_s is None:
                await self._put(work)
            else:
                await asyncio.wait_for(self._put(work), self.timeout_s)
        except asyncio.TimeoutError:
            raise TransferQueueTimeout(
                f"TransferQueue did not take {what} within {self.timeout_s}s; the projector's checkpoint "
                "stays where it was and the page is put again on its next step"
            ) from None
        except Exception as error:
            raise TransferQueueSinkError(
                f"TransferQueue put of {what} failed ({type(error).__name__}: {error}); the projector's "
                "checkpoint stays where it was and the page is put again on its next step. Is this process "
                "connected (transfer_queue.init() or start_transferqueue())?"
            ) from error
        self.rows_put += n_rows
        self.tags_put += n_tags

    def _plan(self, items: Sequence[QueueItem]) -> dict[str, _PartitionWork]:
        work: dict[str, _PartitionWork] = {}
        for item in items:
            target = work.setdefault(self.partition_id(item.partition), _PartitionWork())
            if item.is_tag:
                target.tags[item.key] = {**target.tags.get(item.key, {}), **item.tags}
            else:
                target.rows.pop(item.key, None)  # a re-put key moves to its latest position
                target.rows[item.key] = item
        return work

    async def _put(self, work: Mapping[str, _PartitionWork]) -> None:
        tq = self._tq
        for partition_id, w in work.items():
            rows = list(w.rows.values())
            for start in range(0, len(rows), self.max_rows_per_put):
                chunk = rows[start : start + self.max_rows_per_put]
                await tq.async_kv_batch_put(
                    keys=[item.key for item in chunk],
                    partition_id=partition_id,
                    fields=rows_to_tensordict(
                        chunk,
                        write_log_probs=self.write_log_probs,
                        isolate_placeholders=self.isolate_placeholders,
                    ),
                    tags=[_row_tags(item) for item in chunk],
                )
        for partition_id, w in work.items():
            if w.tags:
                await tq.async_kv_batch_put(
                    keys=list(w.tags), partition_id=partition_id, tags=list(w.tags.values())
                )

    # convenience: read back through the same connection
    def read_rows(
        self, partition: str, keys: Sequence[str], *, pad_token_id: int = 0
    ) -> TensorDict:
        return read_rows(self.partition_id(partition), keys, pad_token_id=pad_token_id)

    async def aread_rows(
        self, partition: str, keys: Sequence[str], *, pad_token_id: int = 0
    ) -> TensorDict:
        return await aread_rows(self.partition_id(partition), keys, pad_token_id=pad_token_id)
