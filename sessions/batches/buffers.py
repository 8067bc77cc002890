"""Output memory the padded writer reuses across steps, once no one holds the earlier batch.

Why: a padded batch's large columns are tens of MiB each; the allocator hands memory that big
back to the OS when a batch is dropped, so the next step's build faults every page in again
(25k-165k page faults a pass of the projection benchmark, 15-25% of ``build_padded``'s time).

The ownership rule: a column the caller holds is never written. The pool keeps only the
*storage* of each large column it handed out, and reuses one only when its use count is 1,
i.e. when the pool's own reference is the last: no tensor, view, ``numpy`` array (from
``Tensor.numpy()`` or DLPack) or other storage reference to that memory is left anywhere in
the process. A storage moved to shared memory (``share_memory_()``, ``torch.multiprocessing``)
is dropped from the pool instead, since another process may still map it. So a training loop
that drops step N's batch before building step N+1's gets N's memory back, already faulted in;
one that keeps batches gets fresh memory each time, as without the pool.

A reused storage may be up to 1/8 larger than the column it backs (steps' widths differ by a
few tokens), so ``untyped_storage().nbytes()`` can exceed ``nbytes``. The pool holds at most
``_PER_COLUMN`` storages for each column name (about two batches' worth of memory while a loop
holds one batch and builds the next); ``release_buffers()`` frees them all.
"""

from __future__ import annotations

import sys
import threading

import torch

__all__ = ["empty_column", "release_buffers"]

#: columns smaller than this come from the allocator's heap, which does not fault them again
_MIN_BYTES = 1 << 20
#: storages kept per column name
_PER_COLUMN = 2
#: a reused storage may exceed the column's bytes by at most this fraction
SLACK = 1 / 8

_lock = threading.Lock()
_pool: dict[str, list[torch.UntypedStorage]] = {}
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _refs(storage: torch.UntypedStorage) -> int:
    return sys.getrefcount(storage)


def _baseline() -> int:
    """References to a kept storage object no one else holds, seen from `_free` in a loop over
    the pool's list (the list, the loop variable, the parameters): measured, not assumed."""
    counts = [_refs(storage) for storage in [torch.empty(1).untyped_storage()]]
    return counts[0]


def _free(storage: torch.UntypedStorage) -> bool:
    """Whether the pool's reference is the only one left to this storage's memory: no tensor or
    view uses it (its C++ use count), and no one holds its Python object (torch hands the same
    object to every ``untyped_storage()`` call, so that count is checked too)."""
    return (
        _use_count is not None
        and _use_count(storage._cdata) == 1
        and _refs(storage) <= _BASELINE + 1  # +1: this frame's own parameter
    )


_BASELINE = _baseline()


def empty_column(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor for column `name`, on memory an earlier batch's
    `name` column no longer uses when there is such memory (see the module docstring)."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < _MIN_BYTES or _use_count is None:
        return torch.empty(shape, dtype=dtype)
    with _lock:
        kept = _pool.setdefault(name, [])
        kept[:] = [s for s in kept if not s.is_shared()]
        for storage in kept:
            if nbytes <= storage.nbytes() <= nbytes * (1 + SLACK) and _free(storage):
                return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        tensor = torch.empty(shape, dtype=dtype)
        if len(kept) >= _PER_COLUMN:
            free = [s for s in kept if _free(s)]
            # evict a free storage (one of the wrong size); if every one is in use, the oldest
            kept.remove(free[0] if free else kept[0])
        kept.append(tensor.untyped_storage())
        return tensor


def release_buffers() -> None:
    """Let go of every kept storage (memory still used by a live batch stays that batch's)."""
    with _lock:
        _pool.clear()
