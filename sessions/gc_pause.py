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

__all__ = ["gc_paused"]


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
