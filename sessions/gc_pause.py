"""Pausing the cyclic garbage collector around work that only allocates long-lived, acyclic
objects: building a batch's non-tensor columns, rebuilding read models from a whole log.

Such work makes the collector scan every object it just made, again and again, as the young
generations fill (a whole-log rebuild of 100k events spent about 40% of its time there); none of
it can free anything, since nothing made forms a cycle. Reference counting still frees as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["built_as_old", "gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a block (unless it is already off); restore after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def built_as_old() -> Iterator[None]:
    """The cyclic GC paused for the block, then every object then tracked moved to the oldest
    generation, for a block that builds many acyclic objects that live on after it.

    Left young, such objects are scanned by the first young collection after the block and their
    survivors again by the next middle one. ``gc.freeze()`` then ``gc.unfreeze()`` promotes them
    without a scan: both only splice the generations' lists (O(1)), and the young count starts
    again from 0. Only a full collection looks at them, as it would once promoted the usual way.

    Process-wide, as the pause is: objects other threads made since the last young collection
    are promoted too (their cyclic garbage then waits for a full collection rather than a young
    one). Skipped, leaving only the pause, when the GC is already off or someone has frozen
    objects (``gc.unfreeze`` would release theirs), and when the block raises.
    """
    if not gc.isenabled() or gc.get_freeze_count():
        with gc_paused():
            yield
        return
    gc.disable()
    try:
        yield
        gc.freeze()
        gc.unfreeze()
    finally:
        gc.enable()
