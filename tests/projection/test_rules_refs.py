"""The projection rules hold no reference cycle: a page's (or a replay's) working set is freed by
reference counting the moment it is done, not by a later cyclic collection over all of it."""

from __future__ import annotations

import gc
import weakref

from sessions.projection.rules import Rules, WorkingSet


def test_a_rules_instance_and_its_working_set_are_freed_without_the_cyclic_collector() -> None:
    gc.collect()
    gc.disable()
    try:
        state = WorkingSet()
        rules = Rules(state)
        gone_rules, gone_state = weakref.ref(rules), weakref.ref(state)
        del rules, state
        assert gone_rules() is None and gone_state() is None
    finally:
        gc.enable()
