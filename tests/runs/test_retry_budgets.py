"""Retry budgets (`RetryPolicy.group_budget` / `step_budget`, docs/failures.md "Retry budgets"):
a retry past a spent budget is refused, the failure records which budget refused it, and a
group left below `min_valid` for it is counted as unusable by that cause. Sessions run one
after another here, so the budgets are exact; a model of the rule says what each must do."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, RetryPolicy, SandboxError
from sessions.errors import ConfigError


def _runner(failures: int):  # noqa: ANN202
    """Fails its first `failures` attempts with a sandbox error, then succeeds."""

    async def run(handle: Any) -> None:
        if handle.attempt <= failures:
            raise SandboxError(f"sandbox of attempt {handle.attempt} died")
        await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
        await handle.post_reward(1.0)

    return run


def _model(
    groups: list[list[int]], attempts: int, group_budget: int | None, step_budget: int | None
) -> list[list[tuple[str, str | None]]]:
    """What each session must end as, (state, retry_refused), run in order."""
    step_taken, out = 0, []
    for group in groups:
        taken, ends = 0, []
        for failures in group:
            attempt, end = 1, None
            while end is None:
                if attempt > failures:
                    end = ("succeeded", None)
                elif attempt >= attempts:
                    end = ("failed", None)
                elif group_budget is not None and taken >= group_budget:
                    end = ("failed", "group_budget")
                elif step_budget is not None and step_taken >= step_budget:
                    end = ("failed", "step_budget")
                else:
                    taken, step_taken, attempt = taken + 1, step_taken + 1, attempt + 1
            ends.append(end)
        out.append(ends)
    return out


async def _run(
    url: str, groups: list[list[int]], policy: RetryPolicy
) -> tuple[list[list[tuple[str, str | None]]], dict[str, float], dict[str, float]]:
    run = f"budget{uuid.uuid4().hex[:8]}"
    async with Ledger.open(url, run=run, retry_policy=policy, circuit_breaker=None) as ledger:
        ends = []
        for g, group in enumerate(groups):
            row = []
            for i, failures in enumerate(group):
                outcome = await ledger.run_session(
                    _runner(failures),
                    f"{run}-g{g}-s{i}",
                    uid=f"{run}-g{g}",
                    session_index=i,
                    group_size=len(group),
                    partition="train",
                    global_step=0,
                )
                view = (await ledger.load_session(outcome.session_id)).view
                refused = None
                if outcome.state == "failed":
                    from sessions import events as ev

                    stored = await ledger.store.read_stream(outcome.session_id)
                    failed = [ev.decode(s).event for s in stored if s.type == "SessionFailed"]
                    refused = failed[0].retry_refused
                row.append((view.state, refused))
            ends.append(row)
        figures = await ledger.metrics_dict("train", 0, timeout=30)
        counts = {
            m.metric: m.value for m in await ledger.metrics("train", 0) if m.data_source is None
        }
    return ends, figures, counts


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), min_size=1, max_size=3),
    group_budget=st.none() | st.integers(0, 2),
    step_budget=st.none() | st.integers(0, 3),
)
def test_budgets_refuse_exactly_the_retries_the_rule_says(
    groups: list[list[int]], group_budget: int | None, step_budget: int | None
) -> None:
    policy = RetryPolicy(max_attempts=3, group_budget=group_budget, step_budget=step_budget)
    with tempfile.TemporaryDirectory() as folder:
        ends, _figures, counts = asyncio.run(_run(str(Path(folder) / "b.db"), groups, policy))
    expected = _model(groups, 3, group_budget, step_budget)
    assert ends == expected
    for budget in ("group_budget", "step_budget"):
        refused = sum(end[1] == budget for group in expected for end in group)
        assert counts.get(f"refused/{budget}", 0.0) == refused


async def test_a_group_left_below_min_valid_by_its_budget_is_counted_unusable(db_url: str) -> None:
    """group_budget 1: the group's first session takes the retry and succeeds; the next two are
    refused theirs and fail; the group has 1 valid row of min_valid 2, so its 3 rows give no
    signal, counted under the group budget. The other group, with no failure, is usable."""
    policy = RetryPolicy(max_attempts=3, group_budget=1)
    ends, figures, counts = await _run(db_url, [[1, 1, 1], [0, 0]], policy)
    assert ends[0] == [("succeeded", None), ("failed", "group_budget"), ("failed", "group_budget")]
    assert counts["refused/group_budget"] == 2
    assert counts["groups/below_min_valid"] == 1
    cost = {k.rsplit("/cost/", 1)[1]: v for k, v in figures.items() if "/all/cost/" in k}
    assert cost["groups_unusable/group_budget"] == 1
    assert cost["rows_unusable/group_budget"] == 3
    assert "groups_unusable/step_budget" not in cost


@pytest.mark.parametrize(
    "bad", [{"group_budget": -1}, {"step_budget": 1.5}, {"group_budget": True}]
)
def test_a_budget_that_is_not_a_count_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="budget must be None"):
        RetryPolicy(**bad)


def test_budgets_join_the_fingerprint_only_when_set() -> None:
    assert "group_budget" not in RetryPolicy().as_config()
    assert RetryPolicy(step_budget=4).as_config()["step_budget"] == 4
