"""What differs between the tensordict versions this package runs on: 0.10.0 (verl 0.9.1's only
accepted pin) to the newest (0.15.3 when this was written). Each difference is probed once, at
import, from the behaviour itself rather than a version number, so a tensordict that behaves
takes the plain path.

* **Storing an empty ``NonTensorStack``** (``EMPTY_STACK_SET_FAILS``). tensordict 0.10.0 raises
  ``IndexError`` from ``TensorDict.set``: its value check asks the stack ``_has_names()``, which
  ``LazyStackedTensorDict`` answers with ``all(...)`` over its members -- True for none -- and
  then reads ``names``, which reads ``tensordicts[0]``. A batch of 0 rows carries every
  non-tensor column as an empty stack, so on such a version ``set_stack`` stores it through
  ``_set_str(..., validated=True)``, tensordict's own path for a value already checked (the
  stack is: its batch size is the batch's). 0.15.3 stores it with ``set``.
* **Row operations on jagged batches** (``NATIVE_JAGGED_ROW_OPS``). torch does not index,
  slice, split or ``cat`` a ``torch.jagged`` nested tensor along its batch dim; tensordict 0.15.3
  does it for the nested tensors of a TensorDict, 0.10.0 does not (``aten.index`` /
  ``slice()`` / ``cat()`` are "not supported for NestedTensor on dim=0"). 0.10.0 also fails any
  row selection that yields no rows (``lazy_stack`` of nothing: "items cannot be empty") and
  any indexing of a batch of 0 rows. These are not patched: ``sessions.batches.indexing``
  (``select_rows``, ``concat_batches``, ``split_batch``) does all of them on every version, and
  the flags say whether plain ``batch[index]`` / ``torch.cat`` also work on a jagged batch
  (``NATIVE_JAGGED_ROW_OPS``) and whether selecting no rows works on a padded one
  (``NATIVE_EMPTY_SELECTION``).
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from sessions.errors import InvalidArgument

__all__ = ["EMPTY_STACK_SET_FAILS", "NATIVE_EMPTY_SELECTION", "NATIVE_JAGGED_ROW_OPS", "set_stack"]


def _empty_stack_set_fails() -> bool:
    """Whether ``TensorDict.set`` refuses an empty NonTensorStack (tensordict 0.10.0)."""
    try:
        TensorDict({}, batch_size=[0]).set("probe", NonTensorStack.from_list([]))
    except IndexError:
        return True
    return False


def _native_jagged_row_ops() -> bool:
    """Whether this tensordict indexes, slices, splits and ``torch.cat``-s jagged batches."""
    values, offsets = torch.arange(3), torch.tensor([0, 1, 3])
    nested = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=1, max_seqlen=2)
    batch = TensorDict({"x": nested}, batch_size=[2])
    try:
        picked = batch[torch.tensor([1, 0])]
        batch[torch.tensor([True, False])], batch[1:], batch.split(1), torch.cat([batch, batch])
    except (RuntimeError, NotImplementedError, IndexError, TypeError):
        return False
    return picked.get("x").unbind()[0].tolist() == [1, 2]


def _native_empty_selection() -> bool:
    """Whether ``batch[index]`` selecting no rows works when the batch has a non-tensor column."""
    batch = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    batch.set("s", NonTensorStack.from_list(["a", "b"]))
    try:
        empty = batch[torch.zeros(0, dtype=torch.int64)]
        empty = batch[1:1]
    except (RuntimeError, IndexError):
        return False
    return tuple(empty.batch_size) == (0,)


def _quiet_torch_fx_notice() -> None:
    """Spend torch's once-per-process ``is_fx_tracing`` notice with its logger off.

    torch (2.13) logs "is_fx_tracing will return true for both fx.symbolic_trace and
    torch.export ..." to stderr the first time ``nested_tensor_from_jagged`` runs (it asks
    ``is_fx_tracing()``, whose notice is an ``lru_cache``-d function). The notice is about
    tracing, which nothing here does; unsilenced it is a stray line in the CLI's one-line errors
    and in every export. Calling the cached function once with its logger disabled uses it up.
    Private torch API, so absent or changed it is simply skipped.
    """
    import logging

    try:
        from torch.fx import _symbolic_trace

        notice = _symbolic_trace.is_fx_tracing_warning
    except (ImportError, AttributeError):
        return
    logger = logging.getLogger(_symbolic_trace.__name__)
    disabled, logger.disabled = logger.disabled, True
    try:
        notice()
    finally:
        logger.disabled = disabled


_quiet_torch_fx_notice()
EMPTY_STACK_SET_FAILS: bool = _empty_stack_set_fails()
NATIVE_EMPTY_SELECTION: bool = _native_empty_selection()
NATIVE_JAGGED_ROW_OPS: bool = _native_jagged_row_ops()


def set_stack(batch: TensorDictBase, name: str, stack: NonTensorStack) -> None:
    """``batch.set(name, stack)``, also for an empty stack on a tensordict that refuses one."""
    if EMPTY_STACK_SET_FAILS and not stack.tensordicts and isinstance(batch, TensorDict):
        if tuple(stack.batch_size) != tuple(batch.batch_size):
            raise InvalidArgument(
                f"column {name!r}: {stack.batch_size} rows for a batch of {batch.batch_size}"
            )
        batch._set_str(name, stack, validated=True, inplace=False, non_blocking=False)
        return
    batch.set(name, stack)
