"""TransferQueue adapter (optional extra ``transferqueue``): the queue verl and uni-agent use.

``TransferQueueSink`` is a ``QueueSink`` the projector writes every projected row and group tag to,
through TransferQueue's key-value API (``async_kv_batch_put``), in uni-agent's conventions:

* row key ``{uid}_{session_index}_{i}`` (``QueueItem.key``), partition ids ``train`` / ``val``;
* one unpadded row per sample: 1-D int64 ``prompts``, ``responses``, ``input_ids``,
  ``attention_mask``, ``position_ids``, ``response_mask`` (and ``loss_mask``, the same values),
  float32 ``rm_scores`` (the reward on the last response token), float32 ``rollout_log_probs``
  (zeros where a row has none, as uni-agent writes them), a per-row int64 ``num_turns``, bool
  ``is_placeholder``, int64 ``prompt_length`` / ``response_length``, and strings (any plain
  scalar) in ``NonTensorStack``: ``uid``, ``data_source``, ``session_id``, ``session_index``,
  ``key``, ``run``, ``partition``, ``global_step``, ``global_steps``, ``failure_reason``,
  ``materialization_reason``;
* per-row tags (``QueueItem.tags``: ``status``, ``global_steps``, ``prompt_len``,
  ``response_len``, ``seq_len``, ``uid``, ``materialization_reason``, ``is_placeholder``; plus
  ``min_global_steps`` / ``max_global_steps`` = ``global_steps`` unless given);
* the group tag on key ``{uid}`` (``{"is_prompt": True, "status": "finished"|"failure",
  "global_steps": s}``), written only after the group's rows. TransferQueue merges tags with
  ``dict.update``, so keys registered earlier (by verl's replay buffer, say) survive.

Writes are idempotent by key: a re-projected row replaces the stored one. A failed or timed-out
put raises ``TransferQueueSinkError``; the projector calls sinks inside its page transaction, so
the page rolls back, the checkpoint stays, and the page is put again on the next step.

``read_rows`` / ``aread_rows`` read rows back with ``kv_batch_get`` and return them padded in
verl's layout (DESIGN section 6); ``start_transferqueue`` starts a local TransferQueue sized for
small machines (tests, a laptop, a 2-core CI box).

``transfer_queue`` is imported lazily: importing this module without the extra works, using it
raises ``ImportError`` naming the extra.
"""

from __future__ import annotations

from sessions.errors import LedgerError

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sessions.queues.sinks import QueueItem

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

log = logging.getLogger(__name__)

__all__ = [
    "TQ_VERSION",
    "TransferQueueHandle",
    "TransferQueueSink",
    "TransferQueueSinkError",
    "TransferQueueStartError",
    "TransferQueueTimeout",
    "aread_rows",
    "import_transfer_queue",
    "list_partition",
    "read_rows",
    "row_keys",
    "rows_to_tensordict",
    "set_tq_num_threads",
    "start_transferqueue",
    "to_padded",
]

#: the TransferQueue release this adapter is written and tested against (pyproject's extra pins it)
TQ_VERSION = "0.1.11"

#: environment Ray and TransferQueue read at start-up (see ``start_transferqueue``)
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}

#: columns ``sessions.batches.densify`` re-lays out; every other column is carried alongside
_DENSIFY_COLUMNS = frozenset(
    {
        "prompts", "responses", "response_mask", "rm_scores", "rollout_log_probs",
        "input_ids", "attention_mask", "position_ids", "prompt_length", "response_length", "is_placeholder",
    }
)


class TransferQueueSinkError(LedgerError, RuntimeError):
    """A TransferQueue put failed; the projector's page rolls back and its checkpoint stays."""


class TransferQueueTimeout(TransferQueueSinkError, TimeoutError):
    """A TransferQueue put did not finish within the sink's ``timeout_s``."""


class TransferQueueStartError(LedgerError, RuntimeError):
    """``start_transferqueue`` could not bring TransferQueue up (nothing it started is left running)."""


def set_tq_num_threads() -> str:
    """Default ``TQ_NUM_THREADS`` to this process's torch thread count; returns the value in force.

    TransferQueue sets ``torch.set_num_threads(TQ_NUM_THREADS)`` (default 8, capped at the physical
    cores, with a warning each time it caps) around every put and get, in the client and in each
    storage unit, then restores the count it saw at import. With ``TQ_NUM_THREADS`` equal to the
    current count that dance is a no-op. TransferQueue reads the variable once, when
    ``transfer_queue`` is imported in the driver (Ray ships its actor classes from there), so this
    must run before anything imports ``transfer_queue``; a value already set is kept.
    """
    if "TQ_NUM_THREADS" not in os.environ:
        if "transfer_queue" in sys.modules:
            log.warning(
                "transfer_queue was imported before TQ_NUM_THREADS was set: TransferQueue will set torch's "
                "thread count to 8 (capped at the physical cores) around every put and get; set TQ_NUM_THREADS "
                "before importing transfer_queue"
            )
        import torch

        os.environ["TQ_NUM_THREADS"] = str(max(1, torch.get_num_threads()))
    return os.environ["TQ_NUM_THREADS"]


def import_transfer_queue() -> ModuleType:
    """``import transfer_queue`` after ``set_tq_num_threads()``, with a clear error without the extra."""
    set_tq_num_threads()
    try:
        import transfer_queue
    except ImportError as error:
        raise ImportError(
            "the TransferQueue adapter needs the optional extra: pip install 'rollout-ledger[transferqueue]' "
            f"(TransferQueue=={TQ_VERSION}, import name transfer_queue)"
        ) from error
    return transfer_queue


# ------------------------------------------------------------------------------------------------
# rows -> TransferQueue fields
# ------------------------------------------------------------------------------------------------


def rows_to_tensordict(items: Sequence[QueueItem], *, write_log_probs: bool = True) -> TensorDict:
    """Row items -> the unpadded TensorDict one ``kv_batch_put`` stores (first dim = sample).

    Built with ``sessions.batches.build_jagged`` (one flat pass, no per-token Python loop), then
    completed with uni-agent's extra columns.
    """
    import torch
    from tensordict import NonTensorStack

    from sessions.batches import build_jagged

    rows = [item.row for item in items]
    if any(row is None for row in rows):
        raise ValueError("rows_to_tensordict takes row items only (QueueItem.row set), not group tags")
    td = build_jagged(rows)  # type: ignore[arg-type]
    responses = td.get("responses")
    if write_log_probs and "rollout_log_probs" not in td.keys():
        zeros = torch.zeros(responses.values().shape[0], dtype=torch.float32)
        td.set("rollout_log_probs", torch.nested.nested_tensor_from_jagged(zeros, responses.offsets()))
    elif not write_log_probs and "rollout_log_probs" in td.keys():
        del td["rollout_log_probs"]
    mask = td.get("response_mask")
    td.set("loss_mask", torch.nested.nested_tensor_from_jagged(mask.values().clone(), mask.offsets()))
    td.set("num_turns", torch.tensor([_num_turns(row) for row in rows], dtype=torch.int64))  # type: ignore[arg-type]
    td.set("global_steps", NonTensorStack.from_list([item.tags.get("global_steps", item.global_step) for item in items]))
    return td


_warned_num_turns = False


def _num_turns(row: Any) -> int:
    """``num_turns`` from the row's meta; 0 for a placeholder (DESIGN section 5); -1 if unknown."""
    global _warned_num_turns
    value = row.meta.get("num_turns") if row.meta is not None else None
    if value is not None:
        return int(value)
    if row.is_placeholder:
        return 0
    if not _warned_num_turns:
        _warned_num_turns = True
        log.warning("queue rows carry no num_turns; TransferQueue rows get num_turns=-1 (unknown)")
    return -1


def _row_tags(item: QueueItem) -> dict[str, Any]:
    tags = dict(item.tags)
    steps = tags.setdefault("global_steps", item.global_step)
    tags.setdefault("min_global_steps", steps)
    tags.setdefault("max_global_steps", steps)
    tags.setdefault("uid", item.uid)
    return tags


@dataclass
class _PartitionWork:
    rows: dict[str, QueueItem] = field(default_factory=dict)  # key -> last item for that key
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> merged tag


# ------------------------------------------------------------------------------------------------
# the sink
# ------------------------------------------------------------------------------------------------


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
    False never writes it. ``max_rows_per_put`` bounds one message.
    """

    def __init__(
        self,
        *,
        timeout_s: float | None = 20.0,
        partition_ids: Mapping[str, str] | None = None,
        write_log_probs: bool = True,
        max_rows_per_put: int = 256,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
        if max_rows_per_put < 1:
            raise ValueError(f"max_rows_per_put must be >= 1, got {max_rows_per_put!r}")
        self.timeout_s = timeout_s
        self.partition_ids = dict(partition_ids or {})
        self.write_log_probs = write_log_probs
        self.max_rows_per_put = max_rows_per_put
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
                    fields=rows_to_tensordict(chunk, write_log_probs=self.write_log_probs),
                    tags=[_row_tags(item) for item in chunk],
                )
        for partition_id, w in work.items():
            if w.tags:
                await tq.async_kv_batch_put(keys=list(w.tags), partition_id=partition_id, tags=list(w.tags.values()))

    # convenience: read back through the same connection
    def read_rows(self, partition: str, keys: Sequence[str], *, pad_token_id: int = 0) -> TensorDict:
        return read_rows(self.partition_id(partition), keys, pad_token_id=pad_token_id)

    async def aread_rows(self, partition: str, keys: Sequence[str], *, pad_token_id: int = 0) -> TensorDict:
        return await aread_rows(self.partition_id(partition), keys, pad_token_id=pad_token_id)


# ------------------------------------------------------------------------------------------------
# reading back: jagged -> padded
# ------------------------------------------------------------------------------------------------


def read_rows(partition_id: str, keys: Sequence[str], *, pad_token_id: int = 0) -> TensorDict:
    """``kv_batch_get`` the keys' rows and return them padded (DESIGN section 6), in ``keys`` order.

    Blocking (TransferQueue's own client thread does the I/O); use ``aread_rows`` in a coroutine.
    """
    keys = list(keys)
    if not keys:
        return _empty_batch(pad_token_id)
    raw = import_transfer_queue().kv_batch_get(keys=keys, partition_id=partition_id)
    return to_padded(raw, pad_token_id=pad_token_id, keys=keys)


async def aread_rows(partition_id: str, keys: Sequence[str], *, pad_token_id: int = 0) -> TensorDict:
    """``async_kv_batch_get`` counterpart of ``read_rows``."""
    keys = list(keys)
    if not keys:
        return _empty_batch(pad_token_id)
    raw = await import_transfer_queue().async_kv_batch_get(keys=keys, partition_id=partition_id)
    return to_padded(raw, pad_token_id=pad_token_id, keys=keys)


def _empty_batch(pad_token_id: int) -> TensorDict:
    from sessions.batches import build_padded

    return build_padded([], pad_token_id=pad_token_id)


def to_padded(raw: TensorDictBase, *, pad_token_id: int = 0, keys: Sequence[str] | None = None) -> TensorDict:
    """What ``kv_batch_get`` returns (jagged nested tensors) -> a padded batch with the original dtypes.

    Section 6 columns go through ``sessions.batches.densify`` (prompts left-padded, responses
    right-padded, ``input_ids`` / ``attention_mask`` / ``position_ids`` re-derived). Other jagged
    columns are padded with 0 to the side they align with (response length: right-padded to the
    responses' width, like ``loss_mask``; sequence length: like ``input_ids``; prompt length:
    left-padded); dense and non-tensor columns pass through. With ``keys`` and a ``key`` column,
    rows are returned in ``keys`` order.
    """
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    from sessions.batches import densify, non_tensor

    batch_size = int(raw.batch_size[0]) if raw.batch_size else 0
    core: dict[str, Any] = {}
    extra: dict[str, torch.Tensor] = {}
    lists: dict[str, list[Any]] = {}
    for name in raw.keys():
        value = raw.get(name)
        if isinstance(value, (NonTensorStack, NonTensorData)):
            lists[name] = non_tensor(raw, name)
        elif name in _DENSIFY_COLUMNS:
            core[name] = value
        elif isinstance(value, torch.Tensor):
            extra[name] = value
        else:
            raise TypeError(f"column {name!r}: unsupported entry of type {type(value).__name__}")
    if "prompts" not in core or "responses" not in core:
        raise ValueError(f"not a row batch: columns {sorted(raw.keys())} lack prompts/responses")
    core.setdefault("is_placeholder", torch.zeros(batch_size, dtype=torch.bool))
    core["is_placeholder"] = core["is_placeholder"].to(torch.bool)
    for name in ("response_mask", "rm_scores"):  # rows from writers without them: all-ones mask, no reward
        if name not in core:
            values = core["responses"].values()
            fill = torch.ones_like(values) if name == "response_mask" else torch.zeros(values.shape[0], dtype=torch.float32)
            core[name] = torch.nested.nested_tensor_from_jagged(fill, core["responses"].offsets())
    jagged = TensorDict(core, batch_size=[batch_size])
    for name, values in lists.items():
        jagged.set(name, NonTensorStack.from_list(list(values)))
    dense = densify(jagged, pad_token_id=pad_token_id)
    widths = (dense.get("prompts").shape[1], dense.get("responses").shape[1])
    lengths = (dense.get("prompt_length"), dense.get("response_length"))
    for name, value in extra.items():
        dense.set(name, _pad_extra(value, lengths, widths))
    if keys is not None and "key" in lists:
        got = lists["key"]
        if got != list(keys):
            index = {k: i for i, k in enumerate(got)}
            missing = [k for k in keys if k not in index]
            if missing:
                raise LookupError(f"TransferQueue returned no rows for keys {missing[:5]}")
            dense = dense[torch.tensor([index[k] for k in keys], dtype=torch.long)]
    return dense


def _pad_extra(value: Any, lengths: tuple[Any, Any], widths: tuple[int, int]) -> Any:
    """Pad one extra column to the side it aligns with (see ``to_padded``); 0 fills the padding."""
    import numpy as np
    import torch

    if not value.is_nested:
        return value
    if value.layout != torch.jagged:
        return torch.nested.to_padded_tensor(value, 0)
    if value.lengths() is not None:  # a view with holes
        value = value.contiguous()
    offsets = value.offsets()
    values = value.values()[int(offsets[0]) : int(offsets[-1])]
    row_lengths = offsets.diff()
    p_len, r_len = lengths
    P, R = widths
    if torch.equal(row_lengths, r_len):  # response side: right-padded to the responses' width
        width, shift = R, torch.zeros_like(r_len)
    elif torch.equal(row_lengths, p_len + r_len):  # [prompt | response], like input_ids
        width, shift = P + R, P - p_len
    elif torch.equal(row_lengths, p_len):  # prompt side: left-padded
        width, shift = P, P - p_len
    else:  # aligned with neither: right-padded to its own longest row
        width, shift = (int(row_lengths.max()) if row_lengths.numel() else 0), torch.zeros_like(row_lengths)
    n = row_lengths.numpy().astype(np.int64, copy=False)
    rows = np.repeat(np.arange(n.size), n)
    positions = np.arange(rows.size) - (np.cumsum(n) - n)[rows]
    rows_t, positions_t = torch.from_numpy(rows), torch.from_numpy(positions)
    out = values.new_zeros((n.size, width, *values.shape[1:]))
    out[rows_t, shift[rows_t] + positions_t] = values
    return out


# ------------------------------------------------------------------------------------------------
# start-up on small machines
# ------------------------------------------------------------------------------------------------


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class TransferQueueHandle:
    """What ``start_transferqueue`` started; ``close()`` (or leaving the ``with``) stops exactly that."""

    config: Any
    ray_cpus: int
    storage_units: int
    started_ray: bool
    startup_s: float
    _env_before: dict[str, str | None] = field(default_factory=dict, repr=False)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """``tq.close()``, then ``ray.shutdown()`` if this handle started Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            import_transfer_queue().close()
        finally:
            try:
                if self.started_ray:
                    import ray

                    ray.shutdown()
            finally:
                _restore_env(self._env_before)

    def __enter__(self) -> TransferQueueHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _restore_env(before: Mapping[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def start_transferqueue(
    *,
    num_cpus: int | None = None,
    storage_units: int | None = None,
    timeout_s: float = 120.0,
    config: Mapping[str, Any] | None = None,
    ray_init_kwargs: Mapping[str, Any] | None = None,
) -> TransferQueueHandle:
    """Start Ray (unless this process already joined one) and a TransferQueue in it.

    * Binds Ray to loopback and turns usage stats off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
      ``RAY_USAGE_STATS_ENABLED=0``; restored on close) and sets ``TQ_NUM_THREADS`` (see
      ``import_transfer_queue``) before Ray's processes start, so they inherit it.
    * ``ray.init(address="local", num_cpus=..., include_dashboard=False)``: a new local instance,
      never someone else's cluster. ``num_cpus`` defaults to the CPUs this process may use (at
      least 2). The controller and each storage unit reserve one Ray CPU, and TransferQueue's
      default of 2 storage units blocks ``tq.init`` forever on a 2-CPU machine, so
      ``storage_units`` defaults to ``min(2, ray_cpus - 1)``: one on 2 cores. More than fit is a
      ``ValueError`` before anything starts.
    * ``tq.init`` runs under ``timeout_s``; if it blocks, what was started is shut down and
      ``TransferQueueStartError`` says why.
    * ``config`` is merged into TransferQueue's (e.g. ``{"controller": {"polling_mode": True}}``).

    If Ray is already initialised in this process, it is used (and left running on close); a
    TransferQueue controller already running there is refused: attach to it with
    ``transfer_queue.init()`` instead — this handle only stops what it started.
    """
    env_before = {name: os.environ.get(name) for name in RAY_LOOPBACK_ENV}
    os.environ.update(RAY_LOOPBACK_ENV)
    started = time.monotonic()
    try:
        tq = import_transfer_queue()
        import ray
    except BaseException:
        _restore_env(env_before)
        raise

    started_ray = False
    try:
        if ray.is_initialized():
            ray_cpus = int(ray.available_resources().get("CPU", 0))
            try:
                ray.get_actor("TransferQueueController", namespace="transfer_queue")
            except ValueError:
                pass
            else:
                raise TransferQueueStartError(
                    "a TransferQueue controller already runs in this Ray cluster; attach with "
                    "transfer_queue.init() and pass TransferQueueSink() to the ledger — start_transferqueue "
                    "only starts (and stops) a TransferQueue of its own"
                )
        else:
            ray_cpus = max(2, int(num_cpus) if num_cpus is not None else _available_cpus())
        units = min(2, ray_cpus - 1) if storage_units is None else int(storage_units)
        if units < 1 or units + 1 > ray_cpus:
            raise ValueError(
                f"TransferQueue needs one Ray CPU for its controller and one per storage unit: "
                f"{units} storage unit(s) need {units + 1} CPUs, Ray has {ray_cpus}"
                + (" available" if ray.is_initialized() else "")
                + "; tq.init would block forever. Use fewer storage units or more num_cpus."
            )
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"address": "local", "num_cpus": ray_cpus, "include_dashboard": False}
            kwargs.update(ray_init_kwargs or {})
            ray.init(**kwargs)
            started_ray = True

        conf: dict[str, Any] = {"backend": {"SimpleStorage": {"num_data_storage_units": units}}}
        if config:
            from omegaconf import OmegaConf

            conf = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(conf), OmegaConf.create(dict(config))))  # type: ignore[assignment]
        final = _init_with_timeout(tq, conf, timeout_s, ray_cpus, units)
    except BaseException:
        try:
            if started_ray:
                try:
                    tq.close()
                finally:
                    ray.shutdown()
        finally:
            _restore_env(env_before)
        raise
    return TransferQueueHandle(
        config=final, ray_cpus=ray_cpus, storage_units=units, started_ray=started_ray,
        startup_s=time.monotonic() - started, _env_before=env_before,
    )


def _init_with_timeout(tq: ModuleType, conf: Mapping[str, Any], timeout_s: float, ray_cpus: int, units: int) -> Any:
    """``tq.init(conf)`` in a daemon thread, so a blocked start-up becomes an error, not a hang."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["config"] = tq.init(conf)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="transferqueue-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TransferQueueStartError(
            f"transfer_queue.init did not return within {timeout_s}s (Ray CPUs: {ray_cpus}, storage units: "
            f"{units}). It blocks when Ray cannot place the controller and storage-unit actors (one CPU "
            "each) — another job may hold Ray's CPUs — or when an actor fails to start; see the Ray logs."
        )
    if "error" in outcome:
        raise TransferQueueStartError(f"transfer_queue.init failed: {outcome['error']}") from outcome["error"]
    return outcome.get("config")


def list_partition(partition_id: str) -> dict[str, dict[str, Any]]:
    """``kv_list(partition_id)`` -> ``{key: tags}`` of that partition (empty if it does not exist)."""
    return dict(import_transfer_queue().kv_list(partition_id=partition_id).get(partition_id, {}))


def row_keys(listing: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The row keys (not group tags) of a ``list_partition`` result, in listing order."""
    return [key for key, tags in listing.items() if not tags.get("is_prompt")]
