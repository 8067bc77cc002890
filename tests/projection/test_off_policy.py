"""Staleness figures (docs/design.md §15): `off_policy_metrics` is verl V1's `training/off_policy/...`
on the rows whose weights versions are known, and `Ledger.metrics_dict` gives them for a train
step recorded through model calls.

verl's figures are computed inline in its V1 `PPOTrainer._compute_metrics` (from the batch's tags
over a TransferQueue), so the verl test takes that block from verl's installed source and runs it
as verl wrote it on the same versions.
"""

from __future__ import annotations

import inspect
import textwrap
import uuid
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions.projection.verl_metrics import off_policy_metrics
from tests.conftest import require_verl

versions = st.lists(
    st.tuples(st.integers(0, 20), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1])),
    min_size=1,
    max_size=30,
)


def _verl_block() -> str:
    """The staleness lines of verl V1's `PPOTrainer._compute_metrics`, as verl wrote them."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    source = textwrap.dedent(inspect.getsource(PPOTrainer._compute_metrics))
    start = source.rindex("\n", 0, source.index("trajectory_spans = ")) + 1
    end = source.index("\n\n", start) if "\n\n" in source[start:] else len(source)
    return textwrap.dedent(source[start:end])


@pytest.mark.verl_env
@settings(max_examples=100, deadline=None)
@given(rows=versions, step=st.integers(1, 40))
def test_the_off_policy_figures_are_verls_own(rows: list[tuple[int, int]], step: int) -> None:
    require_verl()
    namespace: dict[str, Any] = {
        "np": np,
        "metrics": {},
        "global_steps": step,
        "min_global_steps": np.array([r[0] for r in rows], dtype=int),
        "max_global_steps": np.array([r[1] for r in rows], dtype=int),
    }
    exec(_verl_block(), namespace)  # noqa: S102 - verl's own installed source
    verl = {k: float(v) for k, v in namespace["metrics"].items()}
    ours = off_policy_metrics(step, [r[0] for r in rows], [r[1] for r in rows])
    assert {k: v for k, v in ours.items() if k.startswith("training/")} == verl


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.none() | st.tuples(st.integers(0, 9), st.integers(0, 2)), max_size=20))
def test_rows_without_versions_are_left_out_and_spans_are_counted(
    rows: list[tuple[int, int] | None],
) -> None:
    lows = [None if r is None else r[0] for r in rows]
    highs = [None if r is None else r[0] + r[1] for r in rows]
    got = off_policy_metrics(10, lows, highs)
    known = [r for r in rows if r is not None]
    if not known:
        assert got == {}
        return
    assert got["ledger/train/all/off_policy/rows_with_versions"] == len(known)
    assert got["ledger/train/all/off_policy/rows_spanning_updates"] == sum(r[1] > 0 for r in known)
    assert got["training/off_policy/trajectory_spans/max"] == max(r[1] for r in known) + 1
    assert got["training/off_policy/trajectory_staleness_worst/max"] == 9 - min(r[0] for r in known)


async def test_metrics_dict_of_a_train_step_holds_its_staleness(module_db_url: str) -> None:
    """Two sessions recorded through calls at step 5: one on version 4 only, one spanning 2..4;
    a failure's placeholder carries no version and is left out."""
    from sessions import Ledger

    run = f"stale{uuid.uuid4().hex[:8]}"
    async with Ledger.open(module_db_url, run=run) as ledger:
        plans: list[tuple[int, int] | None] = [(4, 4), (2, 4), None]
        for index, plan in enumerate(plans):
            handle = await ledger.create_session(
                f"{run}-{index}",
                uid="u",
                session_index=index,
                group_size=3,
                partition="train",
                global_step=5,
            )
            if plan is None:
                await handle.fail("sandbox_error")
                continue
            call = await handle.start_call()
            await handle.record_call(
                call, prompt_ids=[1], response_ids=[2], min_version=plan[0], max_version=plan[1]
            )
            await handle.post_reward(1.0)
            await handle.complete()
        figures = await ledger.metrics_dict("train", 5, timeout=30)
    assert figures["training/off_policy/trajectory_spans/max"] == 3.0
    assert figures["training/off_policy/trajectory_staleness/max"] == 0.0
    assert figures["training/off_policy/trajectory_staleness_worst/max"] == 2.0
    assert figures["ledger/train/all/off_policy/rows_with_versions"] == 2.0
    assert figures["ledger/train/all/off_policy/rows_spanning_updates"] == 1.0
