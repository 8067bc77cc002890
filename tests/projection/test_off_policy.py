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


async def _group_of_calls(
    ledger: Any, run: str, step: int, sessions: list[list[tuple[int, int]] | None]
) -> None:
    """One train group at `step`: each session a conversation of calls, one per (min, max)
    weights versions given (each call's prompt extends the last), rewarded 1.0; None: a
    sandbox failure (a placeholder, no version)."""
    for index, calls in enumerate(sessions):
        handle = await ledger.create_session(
            f"{run}-{index}",
            uid="u",
            session_index=index,
            group_size=len(sessions),
            partition="train",
            global_step=step,
        )
        if calls is None:
            await handle.fail("sandbox_error")
            continue
        context: list[int] = []
        for turn, (low, high) in enumerate(calls):
            prompt = [*context, 1, 2]
            await handle.record_call(
                await handle.start_call(),
                prompt_ids=prompt,
                response_ids=[3 + turn],
                min_version=low,
                max_version=high,
            )
            context = [*prompt, 3 + turn]
        await handle.post_reward(1.0)
        await handle.complete()


async def test_metrics_dict_of_a_train_step_holds_its_staleness(module_db_url: str) -> None:
    """Two sessions recorded through calls at step 5: one on version 4 only, one spanning 2..4;
    a failure's placeholder carries no version and is left out."""
    from sessions import Ledger

    run = f"stale{uuid.uuid4().hex[:8]}"
    async with Ledger.open(module_db_url, run=run) as ledger:
        await _group_of_calls(ledger, run, 5, [[(4, 4)], [(2, 4)], None])
        figures = await ledger.metrics_dict("train", 5, timeout=30)
    assert figures["training/off_policy/trajectory_spans/max"] == 3.0
    assert figures["training/off_policy/trajectory_staleness/max"] == 0.0
    assert figures["training/off_policy/trajectory_staleness_worst/max"] == 2.0
    assert figures["ledger/train/all/off_policy/rows_with_versions"] == 2.0
    assert figures["ledger/train/all/off_policy/rows_spanning_updates"] == 1.0


# --- the staleness bound (`sessions.projection.staleness`) --------------------------------------
rows_with_versions = st.lists(
    st.one_of(
        st.none(),
        st.tuples(st.integers(0, 12), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1])),
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(
    versions=rows_with_versions,
    step=st.integers(1, 14),
    bound=st.none() | st.integers(0, 12),
    markers=st.integers(0, 2),
)
def test_the_bound_leaves_out_exactly_the_rows_whose_oldest_token_is_too_old(
    versions: list[tuple[int, int] | None], step: int, bound: int | None, markers: int
) -> None:
    from sessions.projection.staleness import split_stale

    rows: list[dict[str, Any]] = [
        {
            "kind": "row",
            "n": i,
            "min_global_steps": None if v is None else v[0],
            "max_global_steps": None if v is None else v[1],
        }
        for i, v in enumerate(versions)
    ]
    rows += [{"kind": "group_end", "n": -1 - i} for i in range(markers)]  # never rows, never cut
    split = split_stale(rows, step, bound)
    worst = {
        r["n"]: (step - 1) - r["min_global_steps"]
        for r in rows
        if r.get("min_global_steps") is not None
    }
    expected = [r for r in rows if bound is None or r["n"] not in worst or worst[r["n"]] <= bound]
    assert split.kept == expected  # the same rows, in their order
    assert split.left_out == len(rows) - len(expected)
    assert split.total == len(versions)
    figures = split.metrics("train")
    if bound is None:
        assert figures == {}
    else:
        assert figures["ledger/train/all/left_out/stale"] == split.left_out
        share = split.left_out / len(versions) if versions else 0.0
        assert figures["ledger/train/all/left_out/stale_share"] == pytest.approx(share)
        kept_worst = [worst[r["n"]] for r in split.kept if r["n"] in worst]
        assert all(age <= bound for age in kept_worst)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_bound_that_is_not_a_count_of_steps_is_refused(bad: Any) -> None:
    from sessions.errors import InvalidArgument
    from sessions.projection.staleness import check_bound

    with pytest.raises(InvalidArgument, match="max_staleness must be a number of steps"):
        check_bound(bad)


async def test_a_session_spanning_a_weight_update_is_left_out_by_the_bound_and_counted(
    module_db_url: str,
) -> None:
    """Step 8 trains weights 7. Session 0 made two calls, served by weights 5 then 7 (spans 3, its
    oldest token 2 steps behind); session 1 is on-policy; session 2 failed (a placeholder, kept:
    its zero stays in the step). `max_staleness=1` leaves session 0 out of the batch and of
    verl's figures, and counts it; `max_staleness=2` keeps everything."""
    from sessions import Ledger
    from sessions.batches import non_tensor

    run = f"bound{uuid.uuid4().hex[:8]}"
    async with Ledger.open(module_db_url, run=run) as ledger:
        await _group_of_calls(ledger, run, 8, [[(5, 5), (7, 7)], [(7, 7), (7, 7)], None])
        everything = await ledger.batch("train", 8, timeout=30, max_staleness=2)
        bounded = await ledger.batch("train", 8, timeout=30, max_staleness=1)
        figures = await ledger.metrics_dict("train", 8, timeout=30, max_staleness=1)
        unbounded = await ledger.metrics_dict("train", 8, timeout=30)
    assert sorted(non_tensor(everything, "session_index")) == [0, 1, 2]
    assert sorted(non_tensor(bounded, "session_index")) == [1, 2]
    assert unbounded["training/off_policy/trajectory_spans/max"] == 3.0
    assert unbounded["ledger/train/all/off_policy/rows_spanning_updates"] == 1.0
    assert "ledger/train/all/left_out/stale" not in unbounded
    assert figures["ledger/train/all/left_out/stale"] == 1.0
    assert figures["ledger/train/all/left_out/stale_share"] == pytest.approx(1 / 3)
    assert figures["training/off_policy/trajectory_spans/max"] == 1.0  # of the rows kept
    assert figures["ledger/train/all/off_policy/rows_spanning_updates"] == 0.0
