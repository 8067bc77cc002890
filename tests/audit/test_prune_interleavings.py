"""Issue 40: generated interleavings of sessions created (late stragglers in old steps too),
ended, projected, pruned and prunes cut between their record and their rewrite, with `audit`
as the oracle after every prune and at the end, on both backends.

What must hold whatever the order: a session in a step some prune recorded is refused
(`StepPrunedError`) and every other creation is accepted; a prune records only steps whose
sessions have all ended; a cut prune is the audit's first finding, named as incomplete, and the
next prune finishes it (and nothing else under its id); every prune id is used once; after
every completed prune, and at the end, the audit is clean.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, StepPrunedError, prune
from sessions.audit.auditing import audit
from sessions.runs import pruning
from sessions.runs.retention import prune_records
from tests.conftest import wipe

STEPS = 4
INCOMPLETE = "is incomplete: run `rollout-ledger prune` again to finish it"

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.integers(0, STEPS - 1)),
        st.tuples(
            st.just("end"), st.integers(0, 63), st.sampled_from(["complete", "fail", "cancel"])
        ),
        st.tuples(st.just("project")),
        st.tuples(st.just("prune"), st.integers(0, STEPS - 1)),
        st.tuples(st.just("cut"), st.integers(0, STEPS - 1)),
    ),
    min_size=1,
    max_size=14,
)


class _Cut(Exception):
    """Stands for the process dying between a prune's record and its rewrite."""


@dataclass
class _Model:
    created: int = 0
    open: list[tuple[str, int, Any]] = field(default_factory=list)  # sid, step, handle
    steps_with_sessions: set[int] = field(default_factory=set)
    pruned: dict[int, str] = field(default_factory=dict)  # step -> prune id, from the log
    cut: set[str] = field(default_factory=set)  # prune ids recorded but not rewritten


async def _refresh(ledger: Ledger, model: _Model) -> None:
    """The pruned steps as the log records them; each recorded step has no open session."""
    records = await prune_records(ledger.engine, "r")
    ids = [r.prune_id for r in records]
    assert len(ids) == len(set(ids)), f"a prune id recorded twice: {ids}"
    steps = [s for r in records for s in r.steps]
    assert len(steps) == len(set(steps)), f"a step pruned twice: {steps}"
    model.pruned = {s: r.prune_id for r in records for s in r.steps}
    touched = {sid for sid, step, _h in model.open if step in model.pruned}
    assert not touched, f"pruned steps with open sessions: {touched}"


async def _clean(ledger: Ledger) -> None:
    checked = await audit(ledger.engine)
    assert checked.ok, [str(d) for d in checked.divergences[:3]]


async def _create(ledger: Ledger, model: _Model, step: int) -> None:
    sid = f"s{model.created}"
    model.created += 1
    if step in model.pruned:
        with pytest.raises(StepPrunedError) as refused:
            await ledger.create_session(
                sid, uid=sid, session_index=0, group_size=1, partition="train", global_step=step
            )
        assert refused.value.prune_id == model.pruned[step]
        return
    handle = await ledger.create_session(
        sid, uid=sid, session_index=0, group_size=1, partition="train", global_step=step
    )
    await handle.record_trajectory(
        prompt_ids=[1, 2, step + 3], response_ids=[4, 5], response_mask=[1, 0]
    )
    model.open.append((sid, step, handle))
    model.steps_with_sessions.add(step)


async def _end(model: _Model, which: int, how: str) -> None:
    if not model.open:
        return
    _sid, _step, handle = model.open.pop(which % len(model.open))
    if how == "complete":
        await handle.complete(score=1.0)
    elif how == "fail":
        await handle.fail("runner_error", message="generated failure")
    else:
        await handle.cancel("generated cancellation")


async def _prune(ledger: Ledger, model: _Model, keep_last: int, *, cut: bool) -> None:
    cut_now: list[str] = []

    async def die(prune_id: str) -> None:
        cut_now.append(prune_id)
        raise _Cut(prune_id)

    pruning.between_record_and_rewrite = die if cut else None
    try:
        report = await prune(ledger, run="r", keep_last=keep_last)
    except _Cut:
        report = None
    finally:
        pruning.between_record_and_rewrite = None
    await _refresh(ledger, model)
    if report is not None:
        assert set(report.finished_prune_ids) == model.cut
        model.cut = set()
        for step in report.pruned_steps:
            assert model.pruned[step] in report.prune_ids
        await _clean(ledger)
        return
    model.cut = set(cut_now)  # a cut prune finished the earlier cut ones before its own record
    checked = await audit(ledger.engine)
    assert not checked.ok
    assert f"prune {cut_now[0]} {INCOMPLETE}" in str(checked.divergences[0])


async def _interleave(url: str, operations: list[tuple[Any, ...]]) -> None:
    model = _Model()
    async with Ledger.open(url, run="r") as ledger:
        for operation in operations:
            kind = operation[0]
            if kind == "create":
                await _create(ledger, model, operation[1])
            elif kind == "end":
                await _end(model, operation[1], operation[2])
            elif kind == "project":
                await ledger.project()
            else:
                await _prune(ledger, model, operation[1], cut=kind == "cut")
        while model.open:
            await _end(model, 0, "complete")
        await _prune(ledger, model, 0, cut=False)
        assert set(model.pruned) == model.steps_with_sessions  # every step with sessions pruned
        await _clean(ledger)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(operations=OPERATIONS)
def test_prune_record_project_interleavings_keep_the_audit_clean(
    module_db_url: str, operations: list[tuple[Any, ...]]
) -> None:
    asyncio.run(wipe(module_db_url))
    asyncio.run(_interleave(module_db_url, operations))
