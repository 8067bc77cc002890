"""Metric counts (docs/design.md §7, `sessions/metrics.py` docstring).

`recompute_from_events` is a brute-force oracle: it reads the raw `events` table, decodes every
event and recomputes every contract metric per (run, partition, global_step, data_source) and the
all-sources row, without touching the projector or `sessions.projection.metrics`. `assert_metrics_match`
compares it with the stored `metric_counts`; the projector's property and concurrency tests use
both. The tests here pin hand-computed figures and the agreement with verl's score metrics.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from sessions import Ledger, PlaceholderPolicy, SandboxError
from sessions import events as ev
from sessions.projection import metrics as m
from store.log.event_store import to_stored
from store.schema.tables import events as events_table
from store.schema.tables import metric_counts

Scope = tuple[str, str, "int | None", "str | None"]

#: metric families whose exact set of names is checked (no spurious reasons or group sizes)
FAMILIES = ("failed/", "reward/mean@", "retries/", "excluded/", "failed_origin/")
#: means that must be absent while their denominator is zero
MEANS = (
    "reward/mean",
    "reward/mean_default_rule",
    "reward/mean_success_only",
    "reward/mean_per_uid",
    "response_length/mean",
    "response_length/max",
    "coverage",
)


# ------------------------------------------------------------------------------------------
# brute-force oracle
# ------------------------------------------------------------------------------------------


@dataclass
class _Session:
    run: str
    uid: str
    group_size: int
    partition: str
    global_step: int | None
    data_source: str | None
    response_lens: dict[int, int] = field(default_factory=dict)
    state: str = "open"
    reason: str | None = None
    selected: list[int] = field(default_factory=list)
    score: float | None = None
    placeholder_reward: float | None = None
    attempts: int = 0
    retries: list[str] = field(default_factory=list)
    origin: str | None = None
    excluded: bool = False
    partial: bool = False
    min_valid: int = 2


def _scopes(run: str, partition: str, step: int | None, source: str | None) -> list[Scope]:
    out: list[Scope] = [(run, partition, step, None)]
    if source is not None:
        out.append((run, partition, step, source))
    return out


async def read_events(engine: AsyncEngine) -> list[ev.Recorded]:
    async with engine.connect() as conn:
        result = await conn.execute(select(events_table).order_by(events_table.c.position))
        return [ev.decode(to_stored(row)) for row in result.mappings()]


async def recompute_from_events(engine: AsyncEngine) -> dict[Scope, dict[str, float]]:
    """Every contract metric, straight from the log (no projector code involved)."""
    sessions: dict[str, _Session] = {}
    group_of: dict[tuple[str, str, int | None, str], list[str]] = defaultdict(list)
    for r in await read_events(engine):
        e = r.event
        if isinstance(e, ev.RunConfigured):
            continue  # a run's configuration stream: no session
        if isinstance(e, ev.SessionCreated):
            sessions[r.session_id] = _Session(
                e.run,
                e.uid,
                e.group_size,
                e.partition,
                e.global_step,
                e.data_source,
                min_valid=2 if e.min_valid is None else e.min_valid,
            )
            group_of[(e.run, e.partition, e.global_step, e.uid)].append(r.session_id)
            continue
        s = sessions[r.session_id]
        if isinstance(e, ev.SessionStarted):
            s.attempts += 1
        elif isinstance(e, ev.AttemptFailed):
            s.retries.append(e.reason)
        elif isinstance(e, ev.TrajectoryRecorded):
            s.response_lens[e.index] = e.response_len
        elif isinstance(e, ev.SessionSucceeded):
            s.state, s.selected, s.score = "succeeded", list(e.selected), e.score
        elif isinstance(e, ev.SessionFailed):
            s.state, s.reason, s.origin, s.excluded = (
                "failed",
                e.reason,
                e.origin,
                e.metric == "exclude",
            )
            if e.placeholder == "keep_partial":
                s.partial, s.selected, s.score = True, list(e.selected), e.score
        elif isinstance(e, ev.PlaceholderEmitted):
            s.placeholder_reward = e.reward
        elif isinstance(e, ev.SessionCancelled):
            s.state = "cancelled"

    counts: dict[Scope, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    # (reward, response_len, succeeded, excluded) per batch row
    rows: dict[Scope, list[tuple[float, int, bool, bool]]] = defaultdict(list)
    for s in sessions.values():
        for scope in _scopes(s.run, s.partition, s.global_step, s.data_source):
            c = counts[scope]
            c["sessions/total"] += 1
            if s.attempts:
                c["attempts/total"] += s.attempts
            if s.retries:
                c["sessions/retried"] += 1
                for reason in s.retries:
                    c[f"retries/{reason}"] += 1
            if s.state != "open":
                c[f"sessions/{s.state}"] += 1
            if s.state == "failed":
                c[f"failed/{s.reason}"] += 1
                c[f"failed_origin/{s.origin}"] += 1
                if s.excluded:
                    c["sessions/excluded"] += 1
                    c[f"excluded/{s.reason}"] += 1
            if s.placeholder_reward is not None:
                c["placeholders"] += 1
                rows[scope].append((s.placeholder_reward, 1, False, s.excluded))
            if s.partial:
                for index in s.selected:
                    c["rows/partial"] += 1
                    rows[scope].append(
                        (
                            0.0 if s.score is None else s.score,
                            s.response_lens[index],
                            False,
                            s.excluded,
                        )
                    )
            if s.state == "succeeded":
                if s.score is None:
                    c["reward/absent"] += 1
                for index in s.selected:
                    rows[scope].append(
                        (0.0 if s.score is None else s.score, s.response_lens[index], True, False)
                    )

    # verl's view of a settled group: its batch rows (a succeeded session's selected trajectories,
    # each with the session's reward; a placeholder's one row); k = its row count.
    uid_means: dict[Scope, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    settled_groups: dict[Scope, int] = defaultdict(int)
    for sids in group_of.values():
        first = sessions[sids[0]]
        values = []  # the rows the metric policy keeps
        valid = 0  # non-placeholder rows, for GRPO's min_valid
        for sid in sids:
            s = sessions[sid]
            if s.state == "succeeded" or s.partial:
                valid += len(s.selected)
                if not s.excluded:
                    values += [0.0 if s.score is None else s.score] * len(s.selected)
            elif s.placeholder_reward is not None and not s.excluded:
                values.append(s.placeholder_reward)
        terminal = sum(sessions[sid].state != "open" for sid in sids)
        settled = terminal >= first.group_size
        for scope in _scopes(first.run, first.partition, first.global_step, first.data_source):
            c = counts[scope]
            c["groups/total"] += 1
            if settled:
                c[
                    "groups/finished"
                    if any(sessions[sid].state == "succeeded" for sid in sids)
                    else "groups/failure"
                ] += 1
                settled_groups[scope] += 1
                if first.partition == "train" and valid < first.min_valid:
                    c["groups/below_min_valid"] += 1
                if values:
                    uid_means[scope][len(values)].append(sum(values) / len(values))

    out: dict[Scope, dict[str, float]] = {}
    for scope, c in counts.items():
        metrics = dict(c)
        for name in (
            "sessions/total",
            "sessions/succeeded",
            "sessions/failed",
            "sessions/cancelled",
            "placeholders",
            "groups/total",
            "groups/finished",
            "groups/failure",
            "reward/absent",
        ):
            metrics.setdefault(name, 0.0)
        metrics["sessions/open"] = (
            metrics["sessions/total"]
            - metrics["sessions/succeeded"]
            - metrics["sessions/failed"]
            - metrics["sessions/cancelled"]
        )
        metrics["groups/unsettled"] = (
            metrics["groups/total"] - metrics["groups/finished"] - metrics["groups/failure"]
        )
        all_rows = rows.get(scope, [])
        ok_rows = [row for row in all_rows if row[2]]
        kept = [row for row in all_rows if not row[3]]
        if all_rows:
            metrics["reward/mean_default_rule"] = sum(row[0] for row in all_rows) / len(all_rows)
        if kept:
            metrics["reward/mean"] = sum(row[0] for row in kept) / len(kept)
        if ok_rows:
            metrics["reward/mean_success_only"] = sum(row[0] for row in ok_rows) / len(ok_rows)
            metrics["response_length/mean"] = sum(row[1] for row in ok_rows) / len(ok_rows)
            metrics["response_length/max"] = float(max(row[1] for row in ok_rows))
        judged = metrics["sessions/succeeded"] + metrics["sessions/failed"]
        if judged:
            metrics["coverage"] = metrics["sessions/succeeded"] / judged
        by_k = uid_means.get(scope, {})
        for k, means in by_k.items():
            metrics[f"reward/mean@{k}"] = sum(means) / len(means)
        every = [mean for means in by_k.values() for mean in means]
        if every:
            metrics["reward/mean_per_uid"] = sum(every) / len(every)
        metrics["reward/uids_excluded"] = settled_groups.get(scope, 0) - (
            len(by_k[max(by_k)]) if by_k else 0
        )
        out[scope] = metrics
    return out


async def stored_metrics(engine: AsyncEngine) -> dict[Scope, dict[str, float]]:
    out: dict[Scope, dict[str, float]] = defaultdict(dict)
    async with engine.connect() as conn:
        for row in (await conn.execute(select(metric_counts))).mappings():
            scope = (row["run"], row["partition"], row["global_step"], row["data_source"])
            assert row["metric"] not in out[scope], (
                f"metric {row['metric']} stored twice for {scope}"
            )
            out[scope][row["metric"]] = row["value"]
    return dict(out)


async def assert_metrics_match(engine: AsyncEngine) -> dict[Scope, dict[str, float]]:
    """Stored metric counts == the brute-force recomputation, scope by scope; returns the oracle."""
    expected = await recompute_from_events(engine)
    stored = await stored_metrics(engine)
    assert set(stored) == set(expected), "metric scopes differ"
    for scope, want in expected.items():
        got = stored[scope]
        for name, value in want.items():
            assert name in got, f"{scope}: {name} missing (expected {value})"
            assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{scope}: {name}"
        for family in FAMILIES:
            assert {k for k in got if k.startswith(family)} == {
                k for k in want if k.startswith(family)
            }, f"{scope}: {family}*"
        for name in MEANS:
            if name not in want:
                assert name not in got, f"{scope}: {name} reported without a denominator"
    return expected


# ------------------------------------------------------------------------------------------
# hand-computed figures, both backends
# ------------------------------------------------------------------------------------------


async def _session(
    ledger: Any,
    sid: str,
    uid: str,
    index: int,
    size: int,
    *,
    source: str | None = "math",
    step: int | None = 0,
    partition: str = "val",
    trajectories: tuple[int, ...] = (),
    reward: float | None = None,
    end: str = "complete",
    selection: str | None = None,
) -> None:
    """One session: `trajectories` lists response lengths (prompt of 2 tokens each)."""
    kw = dict(
        uid=uid,
        session_index=index,
        group_size=size,
        partition=partition,
        global_step=step,
        data_source=source,
    )
    try:
        async with ledger.session(sid, **kw) as s:
            for length in trajectories:
                await s.record_trajectory(
                    prompt_ids=[1, 2],
                    response_ids=list(range(3, 3 + length)),
                    response_mask=[1] * length,
                )
            if reward is not None:
                await s.post_reward(reward)
            if end == "runner":
                raise RuntimeError("runner crashed")
            if end == "sandbox":
                raise SandboxError("sandbox died")
            if end == "timeout":
                raise TimeoutError("took too long")
            if end == "cancel":
                await s.cancel("test cancel")
            elif selection is not None:
                await s.complete(trajectory_selection=selection)
    except (RuntimeError, SandboxError, TimeoutError):
        pass


def _scope_metrics(
    rows: list[m.MetricRow], partition: str, step: int | None, source: str | None
) -> dict[str, float]:
    return {
        r.metric: r.value
        for r in rows
        if (r.partition, r.global_step, r.data_source) == (partition, step, source)
    }


async def test_hand_computed_metrics(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        # uid a (math, n=2): success 1.0 with 2 trajectories (both rows, response 4 and 6), runner error
        await _session(ledger, "a0", "a", 0, 2, trajectories=(4, 6), reward=1.0)
        await _session(ledger, "a1", "a", 1, 2, trajectories=(3,), end="runner")
        # uid b (code, n=2): success with reward never posted (absent -> 0.0, response 2), sandbox error
        await _session(ledger, "b0", "b", 0, 2, source="code", trajectories=(2,))
        await _session(ledger, "b1", "b", 1, 2, source="code", end="sandbox")
        # uid c (math, n=2): success 0.5 selecting the longest of two (response 8), cancelled sibling
        await _session(
            ledger, "c0", "c", 0, 2, trajectories=(8, 5), reward=0.5, selection="longest"
        )
        await _session(ledger, "c1", "c", 1, 2, trajectories=(3,), end="cancel")
        # uid d (math, n=2): one timeout, one still open: unsettled
        await _session(ledger, "d0", "d", 0, 2, end="timeout")
        await ledger.create_session(
            "d1",
            uid="d",
            session_index=1,
            group_size=2,
            partition="val",
            global_step=0,
            data_source="math",
        )
        # another step and partition must not leak into val/0
        await _session(ledger, "t0", "t", 0, 1, partition="train", trajectories=(1,), reward=0.25)
        rows = await ledger.metrics("val", 0)
        await assert_metrics_match(
            ledger.engine
        )  # the oracle agrees with the hand-computed figures below
        everything = _scope_metrics(rows, "val", 0, None)
        math_only = _scope_metrics(rows, "val", 0, "math")
        code_only = _scope_metrics(rows, "val", 0, "code")

    # all sources: rows a0_0 (1.0), a0_1 (1.0), a1 placeholder (0), b0 (0.0 absent), b1 placeholder (0), c0_0 (0.5), d0 placeholder (0)
    assert everything["sessions/total"] == 8
    assert everything["sessions/succeeded"] == 3
    assert everything["sessions/failed"] == 3
    assert everything["sessions/cancelled"] == 1
    assert everything["sessions/open"] == 1
    assert everything["failed/runner_error"] == 1
    assert everything["failed/sandbox_error"] == 1
    assert everything["failed/timeout"] == 1
    assert everything["placeholders"] == 3
    assert everything["reward/absent"] == 1
    assert everything["groups/total"] == 4
    assert everything["groups/finished"] == 3  # a, b, c each have a success; d is unsettled
    assert everything["groups/failure"] == 0
    assert everything["groups/unsettled"] == 1
    assert everything["reward/mean"] == pytest.approx((1.0 + 1.0 + 0 + 0.0 + 0 + 0.5 + 0) / 7)
    assert everything["reward/mean_success_only"] == pytest.approx((1.0 + 1.0 + 0.0 + 0.5) / 4)
    # verl's per-uid means over each settled group's rows: a has 3 rows (1.0, 1.0, 0) -> @3,
    # b 2 rows (0.0, 0) -> @2, c 1 row (0.5; its cancelled sibling has none) -> @1; d is unsettled
    assert everything["reward/mean@3"] == pytest.approx(2 / 3)
    assert everything["reward/mean@2"] == 0.0
    assert everything["reward/mean@1"] == 0.5
    assert sorted(k for k in everything if k.startswith("reward/mean@")) == [
        "reward/mean@1",
        "reward/mean@2",
        "reward/mean@3",
    ]
    assert everything["reward/mean_per_uid"] == pytest.approx((2 / 3 + 0.0 + 0.5) / 3)
    assert everything["reward/uids_excluded"] == 2  # b and c are outside the headline mean@3
    assert everything["coverage"] == pytest.approx(3 / 6)
    assert everything["response_length/mean"] == pytest.approx((4 + 6 + 2 + 8) / 4)
    assert everything["response_length/max"] == 8

    assert math_only["sessions/total"] == 6
    assert math_only["reward/mean"] == pytest.approx((1.0 + 1.0 + 0 + 0.5 + 0) / 5)
    assert math_only["reward/mean_success_only"] == pytest.approx(2.5 / 3)
    assert math_only["reward/mean@3"] == pytest.approx(2 / 3) and math_only["reward/mean@1"] == 0.5
    assert "reward/mean@2" not in math_only
    assert math_only["reward/mean_per_uid"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert math_only["reward/uids_excluded"] == 1
    assert math_only["groups/total"] == 3
    assert "failed/sandbox_error" not in math_only
    assert code_only["reward/mean"] == 0.0
    assert code_only["reward/mean_success_only"] == 0.0
    assert code_only["reward/absent"] == 1
    assert code_only["coverage"] == pytest.approx(0.5)
    assert code_only["groups/finished"] == 1
    assert code_only["reward/mean@2"] == 0.0 and code_only["reward/uids_excluded"] == 0


async def test_drop_policy_keeps_failures_out_of_means(db_url: str) -> None:
    policy = PlaceholderPolicy(rules={"val": {"sandbox_error": "drop"}})
    async with Ledger.open(db_url, placeholder_policy=policy) as ledger:
        await _session(ledger, "a0", "a", 0, 3, trajectories=(2,), reward=1.0)
        await _session(ledger, "a1", "a", 1, 3, end="sandbox")  # dropped: no row, not a zero
        await _session(ledger, "a2", "a", 2, 3, end="timeout")  # emitted: a zero
        got = _scope_metrics(await ledger.metrics("val", 0), "val", 0, None)
        await assert_metrics_match(ledger.engine)
    assert got["sessions/failed"] == 2
    assert got["placeholders"] == 1
    assert got["reward/mean"] == pytest.approx(0.5)
    assert got["reward/mean@2"] == pytest.approx(
        0.5
    )  # the group of 3 has 2 rows: verl files it under mean@2
    assert "reward/mean@3" not in got and got["reward/uids_excluded"] == 0
    assert got["coverage"] == pytest.approx(1 / 3)
    assert got["groups/finished"] == 1


async def test_metrics_agree_with_verl_score_and_validation_metrics(sqlite_url: str) -> None:
    """`reward/mean` is verl's critic/score/mean on the exported batch; `reward/mean@k` is its
    `val-core/<source>/reward/mean@k`: the batch rows grouped by uid (every row), per uid the mean
    over its k rows, then per k the mean over the uids with k rows. (tests/projection/test_verl_metrics.py
    checks the same against verl's own code.)"""
    import numpy as np

    from sessions.batches import non_tensor

    async with Ledger.open(sqlite_url) as ledger:
        plan = {  # uid -> per session: (trajectory response lengths, reward, end)
            "p": [
                ((3, 5), 1.0, "complete"),
                ((2,), 0.0, "complete"),
                ((), None, "runner"),
                ((4,), 0.75, "complete"),
            ],
            "q": [
                ((1,), None, "sandbox"),
                ((2,), None, "timeout"),
                ((6,), 0.25, "complete"),
                ((2, 2, 2), 0.5, "complete"),
            ],
            "r": [
                ((3,), None, "runner"),
                ((), None, "complete"),
                ((1,), None, "sandbox"),
                ((5,), None, "timeout"),
            ],
            "s": [
                ((2,), 1.0, "complete"),
                ((3,), 0.5, "complete"),
                ((1,), None, "cancel"),
                ((), None, "runner"),
            ],
            "v": [
                ((2,), 0.5, "complete"),
                ((1,), None, "runner"),
                ((3,), 1.0, "complete"),
                ((2,), 0.0, "complete"),
            ],
        }
        for uid, sessions in plan.items():
            for i, (lengths, reward, end) in enumerate(sessions):
                await _session(
                    ledger,
                    f"{uid}{i}",
                    uid,
                    i,
                    4,
                    source="math",
                    trajectories=lengths,
                    reward=reward,
                    end=end,
                )
        rows = await ledger.metrics("val", 0)
        batch = await ledger.batch("val", 0, timeout=5)
    got = _scope_metrics(rows, "val", 0, None)

    # verl compute_data_metrics: sequence score = rm_scores.sum(-1), over rows with response_length > 0
    score = batch["rm_scores"].sum(-1)
    attended = batch["attention_mask"][:, -batch["responses"].shape[1] :].sum(-1)
    assert torch_equal(attended, batch["response_length"])
    assert got["reward/mean"] == pytest.approx(float(score[attended > 0].double().mean()))

    per_uid: dict[str, list[float]] = defaultdict(list)
    for uid, value in zip(non_tensor(batch, "uid"), score.tolist()):
        per_uid[uid].append(value)
    by_k: dict[int, list[float]] = defaultdict(list)
    for values in per_uid.values():
        by_k[len(values)].append(float(np.mean(values)))
    assert {k: len(means) for k, means in by_k.items()} == {
        5: 1,
        6: 1,
        4: 2,
        3: 1,
    }  # s lost a session to cancellation
    assert sorted(k for k in got if k.startswith("reward/mean@")) == [
        f"reward/mean@{k}" for k in sorted(by_k)
    ]
    for k, means in by_k.items():
        assert got[f"reward/mean@{k}"] == pytest.approx(float(np.mean(means)), abs=1e-6)
    every = [mean for means in by_k.values() for mean in means]
    assert got["reward/mean_per_uid"] == pytest.approx(float(np.mean(every)), abs=1e-6)
    assert got["reward/uids_excluded"] == 4  # only q has the largest row count, 6
    # and the inflated figure differs: it ignores the failed sessions
    assert got["reward/mean_success_only"] > got["reward/mean"]


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a.to(torch.int64), b.to(torch.int64)))


# ------------------------------------------------------------------------------------------
# MetricTable arithmetic (pure)
# ------------------------------------------------------------------------------------------


def test_metric_table_derives_means_and_drops_undefined_ones() -> None:
    table = m.MetricTable()
    table.derive()
    assert "reward/mean" not in table.values and "coverage" not in table.values
    assert (
        table.values["sessions/failed"] == 0 and table.values["groups/failure"] == 0
    )  # zero counts are reported
    for name, amount in [
        ("sessions/total", 5),
        ("sessions/succeeded", 2),
        ("sessions/failed", 2),
        ("sessions/cancelled", 1),
        ("rows/total", 4),
        ("rows/succeeded", 2),
        ("reward/sum", 1.5),
        ("reward/sum_success_only", 1.5),
        ("groups/total", 3),
        ("groups/finished", 1),
        ("groups/failure", 1),
        ("reward/uid_mean_sum@4", 1.25),
        ("reward/uids@4", 1),
        ("reward/uid_mean_sum@3", 0.5),
        ("reward/uids@3", 1),
        ("reward/uid_mean_sum", 1.75),
        ("reward/uids", 2),
    ]:
        table.add(name, amount)
    table.maximum("response_length/max", 7)
    table.maximum("response_length/max", 3)
    table.derive()
    v = table.values
    assert v["reward/mean"] == pytest.approx(1.5 / 4)
    assert v["reward/mean_success_only"] == pytest.approx(1.5 / 2)
    assert v["reward/mean@4"] == 1.25 and v["reward/mean@3"] == 0.5
    assert v["reward/mean_per_uid"] == pytest.approx(1.75 / 2)
    assert v["reward/uids_excluded"] == 1  # two settled groups, one with the largest row count (4)
    assert v["coverage"] == pytest.approx(0.5)
    assert v["groups/unsettled"] == 1
    assert v["sessions/open"] == 0
    assert v["response_length/max"] == 7
    assert not math.isnan(v["reward/mean"])


@given(
    groups=st.lists(
        st.tuples(st.integers(0, 6), st.lists(st.floats(-1e308, 1e308), min_size=6, max_size=6)),
        max_size=12,
    )
)
@settings(max_examples=200, deadline=None)
def test_counting_settled_groups_as_the_rules_do_derives_verls_means(
    groups: list[tuple[int, list[float]]],
) -> None:
    """Settled groups (k rows each, k = 0 for a group with no row left), counted as
    `rules._settle` counts them: `reward/mean@k` is the mean over the groups with k rows of their
    row means, `reward/mean_per_uid` the mean over every group with a row, `reward/uids_excluded`
    the groups outside the largest k; nothing is NaN, even where a group's sum leaves the range."""
    table = m.MetricTable()
    by_k: dict[int, list[float]] = defaultdict(list)
    for k, rewards in groups:
        table.add(m.GROUPS_FINISHED)
        if k:
            total = 0.0
            for reward in rewards[:k]:
                total += reward
            mean = m.group_mean(total, k)
            assert math.isfinite(mean)
            if math.isfinite(total):
                assert mean == total / k
            else:
                assert abs(mean) == sys.float_info.max and math.copysign(1, mean) == math.copysign(
                    1, total
                )
            by_k[k].append(mean)
            for name, amount in (
                (m.UID_MEAN_SUM.format(n=k), mean),
                (m.UIDS.format(n=k), 1.0),
                (m.UID_MEAN_SUM_ALL, mean),
                (m.UIDS_ALL, 1.0),
            ):
                table.add(name, amount)
    table.derive()
    v = table.values
    assert not any(math.isnan(value) for value in v.values())
    assert {name for name in v if name.startswith("reward/mean@")} == {
        f"reward/mean@{k}" for k in by_k
    }
    for k, means in by_k.items():
        assert v[f"reward/uids@{k}"] == len(means)
        if all(abs(mean) < 1e300 for mean in means):
            assert v[f"reward/mean@{k}"] == pytest.approx(
                sum(means) / len(means), rel=1e-9, abs=1e-300
            )
    every = [mean for means in by_k.values() for mean in means]
    assert ("reward/mean_per_uid" in v) == bool(every)
    assert v["reward/uids_excluded"] == len(groups) - (len(by_k[max(by_k)]) if by_k else 0)


def test_scopes_add_the_all_sources_row() -> None:
    assert sorted(m.scopes("r", "val", 3, "gsm8k"), key=repr) == sorted(
        [("r", "val", 3, "gsm8k"), ("r", "val", 3, None)], key=repr
    )
    assert m.scopes("r", "train", None, None) == [("r", "train", None, None)]


async def test_metrics_select_one_step_every_step_or_the_step_less_sessions(
    sqlite_url: str,
) -> None:
    """`global_step=None` means the sessions recorded without a step, not "any step"; the CLI's
    `--step none` reaches the same rows."""
    import json as json_module

    from sessions.cli.main import main as cli_main

    async with Ledger.open(sqlite_url, run="r") as ledger:
        await _session(ledger, "s0", "a", 0, 1, step=0, trajectories=(2,), reward=1.0)
        await _session(ledger, "s1", "b", 0, 1, step=1, trajectories=(2,), reward=1.0)
        await _session(ledger, "sn", "c", 0, 1, step=None, trajectories=(2,), end="runner")
        steps = lambda rows: {row.global_step for row in rows}  # noqa: E731
        assert steps(await ledger.metrics("val")) == {0, 1, None}
        assert steps(await ledger.metrics("val", 1)) == {1}
        stepless = await ledger.metrics("val", None)
        assert steps(stepless) == {None}
        assert _scope_metrics(stepless, "val", None, None)["sessions/failed"] == 1
    import asyncio
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the CLI runs its own event loop: give it a thread
        assert (
            await asyncio.to_thread(
                cli_main, ["metrics", "--db", sqlite_url, "--run", "r", "--step", "none", "--json"]
            )
            == 0
        )
    assert {row["global_step"] for row in json_module.loads(out.getvalue())} == {None}
