"""Failure semantics: retries, origins, metric and placeholder policies, placeholder
shapes, min_valid and run fingerprints — each recorded in the events it affects.

- A hypothesis test drives sessions through `Ledger.run_session` with random attempt sequences
  and random policies: the batch holds one outcome per session (its final attempt), no token of a
  superseded attempt reaches it, and every metric equals the brute-force recount from the raw
  events (`tests.projection.test_metrics.assert_metrics_match`, extended for attempts, exclusions and partial
  rows).
- One hand-computed run exercises every policy on both backends, then is replayed into an empty
  database: the replay equals the live read models row for row.
- The run fingerprint refuses a changed configuration, names what changed, and records an
  explicit resume.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import (
    Ledger,
    MetricPolicy,
    PlaceholderPolicy,
    RetryPolicy,
    RolloutFailure,
    RunConfigMismatch,
    SandboxError,
)
from sessions import events as ev
from sessions.batches import non_tensor
from sessions.batches.advantage import grpo_outcome_advantage
from sessions.batches.reward_info import default_for, reward_info_columns
from tests.audit.test_replay_equivalence import check_equivalence
from tests.conftest import backend_of, fresh_database
from tests.projection.test_metrics import assert_metrics_match

#: A session's attempt: what the runner does. "ok" records and succeeds; "partial" records a
#: trajectory and a reward, then times out; "late_sandbox" records them, then its sandbox dies
#: (infra: retried, so its work is superseded); the others raise before recording anything.
ATTEMPTS = ("ok", "partial", "late_sandbox", "sandbox", "runner", "quota")
_runs = itertools.count()


def _tokens(session: int, attempt: int, length: int) -> list[int]:
    """Token ids that name the session and attempt, so a superseded attempt's tokens are findable."""
    return [1000 * session + 100 * attempt + i for i in range(length)]


def _runner(index: int, plan: list[str], reward: float) -> Any:
    async def run(handle: Any) -> None:
        attempt = handle.attempt
        step = plan[min(attempt, len(plan)) - 1]
        length = 2 + (index + attempt) % 3
        if step in ("ok", "partial", "late_sandbox"):
            await handle.record_trajectory(
                prompt_ids=_tokens(index, attempt, 2), response_ids=_tokens(index, attempt, length)
            )
            await handle.post_reward(reward, acc=reward)
        if step == "partial":
            raise TimeoutError("the verifier graded partial work, then the tool call hung")
        if step in ("sandbox", "late_sandbox"):
            raise SandboxError("container exited 137")
        if step == "runner":
            raise RuntimeError("tool call parser failed")
        if step == "quota":
            raise RolloutFailure("tool quota exhausted", reason="tool_quota", origin="infra")

    return run


policies = st.fixed_dictionaries(
    {
        "max_attempts": st.integers(1, 3),
        "retry_on": st.sampled_from([("infra",), ("sandbox_error",), ("infra", "runner_error")]),
        "metric": st.sampled_from(
            [
                {},
                {"*": {"infra": "exclude"}},
                {"val": {"timeout": "exclude", "tool_quota": "exclude"}},
            ]
        ),
        "placeholder": st.sampled_from(
            [{}, {"*": {"timeout": "keep_partial"}}, {"train": {"infra": "drop"}}]
        ),
        "lengths": st.sampled_from([(1, 1), (4, 4), (2, 8)]),
        "min_valid": st.integers(0, 3),
    }
)
groups = st.lists(
    st.lists(st.lists(st.sampled_from(ATTEMPTS), min_size=1, max_size=3), min_size=1, max_size=4),
    min_size=1,
    max_size=3,
)


@pytest.fixture(scope="module")
def sqlite_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fresh_database("sqlite", tmp_path_factory.mktemp("failures")) as url:
        yield url


async def _record(
    url: str, run: str, policy: dict[str, Any], plans: list[list[list[str]]], partition: str
) -> dict[str, Any]:
    options = dict(
        run=run,
        retry_policy=RetryPolicy(max_attempts=policy["max_attempts"], on=policy["retry_on"]),
        metric_policy=MetricPolicy(rules=policy["metric"]),
        placeholder_policy=PlaceholderPolicy(
            rules=policy["placeholder"],
            prompt_length=policy["lengths"][0],
            response_length=policy["lengths"][1],
        ),
        min_valid=policy["min_valid"],
    )
    outcomes: dict[str, Any] = {}
    async with Ledger.open(url, **options) as ledger:
        index = 0
        for g, group in enumerate(plans):
            for k, plan in enumerate(group):
                sid = f"{run}-g{g}-s{k}"
                outcomes[sid] = (
                    index,
                    plan,
                    await ledger.run_session(
                        _runner(index, plan, reward=0.25 * (index % 4)),
                        sid,
                        uid=f"{run}-g{g}",
                        session_index=k,
                        group_size=len(group),
                        partition=partition,
                        global_step=0,
                    ),
                )
                index += 1
        batch = await ledger.batch(partition, 0, timeout=10)
        await assert_metrics_match(ledger.engine)
    return {"outcomes": outcomes, "batch": batch}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(policy=policies, plans=groups, partition=st.sampled_from(["train", "val"]))
def test_one_outcome_per_session_from_its_final_attempt(
    sqlite_file: str, policy: dict[str, Any], plans: list[list[list[str]]], partition: str
) -> None:
    run = f"prop{next(_runs)}"  # a run per example: each has its own configuration
    got = asyncio.run(_record(sqlite_file, run, policy, plans, partition))
    batch, outcomes = got["batch"], got["outcomes"]
    sessions = non_tensor(batch, "session_id")
    for sid, (index, plan, outcome) in outcomes.items():
        attempts = outcome.attempts
        assert 1 <= attempts <= policy["max_attempts"]
        final = plan[min(attempts, len(plan)) - 1]
        rows = [i for i, s in enumerate(sessions) if s == sid]
        assert len(rows) <= 1, "one row per session (selection 'all' of one trajectory each)"
        for i in rows:  # the row's tokens are the final attempt's, or the placeholder's
            attended = batch["attention_mask"][i].bool()
            tokens = set(batch["input_ids"][i][attended].tolist())
            if not bool(batch["is_placeholder"][i]):
                assert tokens <= set(_tokens(index, attempts, 10)), (
                    f"{sid}: a superseded attempt's tokens reached the batch"
                )
            else:
                assert (
                    int(attended.sum()) == sum(policy["lengths"])
                    and int(batch["response_mask"][i].sum()) == 0
                )
                assert float(batch["rm_scores"][i].sum()) == 0.0
        if final == "ok":
            assert outcome.state == "succeeded" and len(rows) == 1
        else:
            assert outcome.state == "failed"
        # what was retried is exactly what the policy retries
        reasons = {
            "sandbox": ("sandbox_error", "infra"),
            "late_sandbox": ("sandbox_error", "infra"),
            "runner": ("runner_error", "policy"),
            "quota": ("tool_quota", "infra"),
            "partial": ("timeout", "policy"),
        }

        def retried(step: str, reasons: dict[str, tuple[str, str]] = reasons) -> bool:
            reason, origin = reasons[step]
            return reason in policy["retry_on"] or origin in policy["retry_on"]

        assert all(
            retried(step) for step in (plan[min(n, len(plan)) - 1] for n in range(1, attempts))
        )
        if final != "ok":
            assert attempts == policy["max_attempts"] or not retried(final)


# ------------------------------------------------------------------ hand-computed, both backends, replayed
async def _hand_run(url: str) -> dict[str, Any]:
    """Four groups of two in val and train with every policy in play (see the test for the figures)."""
    options = dict(
        run="hand",
        retry_policy=RetryPolicy(max_attempts=2, on=("infra",)),
        metric_policy=MetricPolicy(rules={"val": {"infra": "exclude"}}),
        placeholder_policy=PlaceholderPolicy(
            rules={"*": {"timeout": "keep_partial"}}, prompt_length=4, response_length=4
        ),
        min_valid=2,
    )
    plans = {  # group -> (plan, reward) per session
        "a": [
            (["late_sandbox", "ok"], 1.0),
            (["ok"], 0.5),
        ],  # retried (its first trajectory superseded), then succeeded
        "b": [
            (["sandbox", "sandbox"], 0.0),
            (["ok"], 1.0),
        ],  # infra failure after 2 attempts (excluded in val)
        "c": [
            (["partial"], 0.75),
            (["runner"], 0.0),
        ],  # partial row 0.75; a policy failure (a zero)
        "d": [(["quota", "runner"], 0.0), (["ok"], 0.0)],  # retried, then a policy failure
    }
    async with Ledger.open(url, **options) as ledger:
        index = 0
        for partition in ("val", "train"):
            for g, group in plans.items():
                for k, (plan, reward) in enumerate(group):
                    await ledger.run_session(
                        _runner(index, plan, reward),
                        f"{partition}-{g}{k}",
                        uid=f"{partition}-{g}",
                        session_index=k,
                        group_size=2,
                        partition=partition,
                        global_step=0,
                    )
                    index += 1
        out = {p: await ledger.batch(p, 0, timeout=10, reward_info=True) for p in ("val", "train")}
        metrics = await ledger.metrics(project=True)
        await assert_metrics_match(ledger.engine)
    out["metrics"] = {(r.partition, r.metric): r.value for r in metrics if r.data_source is None}
    return out


async def test_every_policy_by_hand_on_both_backends_and_through_replay(
    db_url: str, tmp_path: Path
) -> None:
    got = await _hand_run(db_url)
    v = {name: value for (partition, name), value in got["metrics"].items() if partition == "val"}
    t = {name: value for (partition, name), value in got["metrics"].items() if partition == "train"}
    # rows (val): a0 1.0, a1 0.5, b0 placeholder (infra, excluded), b1 1.0, c0 partial 0.75, c1 placeholder 0, d0 placeholder 0, d1 0.0
    assert v["attempts/total"] == 8 + 3 and v["sessions/retried"] == 3
    assert v["retries/sandbox_error"] == 2 and v["retries/tool_quota"] == 1
    assert (
        v["sessions/failed"] == 4
        and v["failed_origin/infra"] == 1
        and v["failed_origin/policy"] == 3
    )
    assert (
        v["sessions/excluded"] == 1 and v["excluded/sandbox_error"] == 1 and v["rows/excluded"] == 1
    )
    assert v["rows/partial"] == 1 and v["placeholders"] == 3
    assert v["reward/mean_default_rule"] == pytest.approx((1 + 0.5 + 0 + 1 + 0.75 + 0 + 0 + 0) / 8)
    assert v["reward/mean"] == pytest.approx((1 + 0.5 + 1 + 0.75 + 0 + 0 + 0) / 7)  # b0 left out
    assert v["reward/mean_success_only"] == pytest.approx(
        (1 + 0.5 + 1 + 0) / 4
    )  # the partial row is no success
    assert (
        v["reward/mean@2"] == pytest.approx((0.75 + (0.75 + 0) / 2 + 0) / 3)
        and v["reward/mean@1"] == 1.0
    )  # b files under @1
    assert v["coverage"] == pytest.approx(4 / 8)
    # train: nothing excluded, so the two figures agree; groups b, c, d have fewer than 2 valid rows
    assert (
        t["reward/mean"]
        == t["reward/mean_default_rule"]
        == pytest.approx((1 + 0.5 + 0 + 1 + 0.75 + 0 + 0 + 0) / 8)
    )
    assert (
        "sessions/excluded" not in t and t["groups/below_min_valid"] == 3
    )  # b, c (its partial row) and d: 1 valid row each
    assert "groups/below_min_valid" not in v

    val = got["val"]
    keys = non_tensor(val, "key")
    placeholder = val["is_placeholder"]
    assert int(placeholder.sum()) == 3 and non_tensor(val, "is_partial").count(True) == 1
    for i in (
        torch.nonzero(placeholder).flatten().tolist()
    ):  # 4 + 4 tokens, all attended, none trainable, reward 0
        assert int(val["attention_mask"][i].sum()) == 8 and int(val["response_mask"][i].sum()) == 0
        assert float(val["rm_scores"][i].sum()) == 0.0 and float(val["response_length"][i]) == 4.0
    partial = non_tensor(val, "is_partial").index(True)
    assert (
        keys[partial].startswith("val-c_0_")
        and non_tensor(val, "failure_reason")[partial] == "timeout"
    )
    assert (
        float(val["rm_scores"][partial].sum()) == 0.75
        and int(val["response_mask"][partial].sum()) > 0
    )
    # reward_info: every row has `acc`; a placeholder's is 0.0 (it posted none; a superseded attempt's is forgotten)
    acc = dict(zip(non_tensor(val, "session_id"), non_tensor(val, "acc")))
    assert acc == {
        "val-a0": 1.0,
        "val-a1": 0.5,
        "val-b0": 0.0,
        "val-b1": 1.0,
        "val-c0": 0.75,
        "val-c1": 0.0,
        "val-d0": 0.0,
        "val-d1": 0.0,
    }

    # GRPO: the train groups below min_valid give no signal
    train = got["train"]
    advantage = grpo_outcome_advantage(train, min_valid=2)
    uids = non_tensor(train, "uid")
    for i, uid in enumerate(uids):
        if uid in ("train-b", "train-c", "train-d"):
            assert advantage[i].abs().sum() == 0, uid

    with fresh_database(backend_of(db_url), tmp_path, "replayed") as target:
        await check_equivalence(db_url, target)


# ------------------------------------------------------------------ retries and cancellation
async def test_cancelling_during_the_backoff_is_a_pure_abort(sqlite_url: str) -> None:
    async with Ledger.open(
        sqlite_url, retry_policy=RetryPolicy(max_attempts=3, backoff_s=30.0)
    ) as ledger:
        task = asyncio.ensure_future(
            ledger.run_session(
                _runner(0, ["sandbox", "ok"], 1.0),
                "s",
                uid="u",
                session_index=0,
                group_size=1,
                partition="val",
            )
        )
        for _ in range(200):
            await asyncio.sleep(0.01)
            if (await ledger.store.stream_version("s")) >= 3:  # created, started, attempt failed
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stored = [ev.decode(s).event for s in await ledger.store.read_stream("s")]
        assert [e.TYPE for e in stored] == [
            "SessionCreated",
            "SessionStarted",
            "AttemptFailed",
            "SessionCancelled",
        ]
        figures = {
            r.metric: r.value for r in await ledger.metrics("val", None) if r.data_source is None
        }
    assert (
        figures["sessions/cancelled"] == 1
        and figures["placeholders"] == 0
        and figures["sessions/retried"] == 1
    )


async def test_session_attempts_view_lists_every_attempt(sqlite_url: str) -> None:
    from sqlalchemy import text

    async with Ledger.open(sqlite_url, retry_policy=RetryPolicy(max_attempts=3)) as ledger:
        await ledger.run_session(
            _runner(0, ["sandbox", "quota", "ok"], 1.0),
            "s",
            uid="u",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=0,
        )
        async with ledger.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT attempt, outcome, reason, superseded FROM session_attempts WHERE session_id = 's' ORDER BY attempt"
                    )
                )
            ).all()
    assert [tuple(r) for r in rows] == [
        (1, "retried", "sandbox_error", 1),
        (2, "retried", "tool_quota", 1),
        (3, "succeeded", None, 0),
    ]


def test_policies_refuse_what_they_cannot_mean() -> None:
    for bad in (
        {"max_attempts": 0},
        {"max_attempts": True},
        {"on": "infra"},
        {"on": ("Bad Reason",)},
        {"backoff_s": -1.0},
        {"multiplier": 0.5},
    ):
        with pytest.raises(ValueError, match="retry policy"):
            RetryPolicy(**bad)
    with pytest.raises(ValueError, match="metric policy"):
        MetricPolicy(rules={"val": {"timeout": "drop"}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="metric policy"):
        MetricPolicy(origins={"timeout": "model"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="prompt_length"):
        PlaceholderPolicy(prompt_length=0)
    with pytest.raises(ValueError, match="origin"):
        RolloutFailure("x", origin="model")
    assert (
        RetryPolicy(max_attempts=5, backoff_s=1.0, multiplier=3.0, max_backoff_s=5.0).backoff(3)
        == 5.0
    )


@given(
    values=st.lists(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-5, 5),
            st.floats(allow_nan=False),
            st.text(max_size=3),
        ),
        max_size=6,
    ),
    holes=st.lists(st.booleans(), min_size=1, max_size=6),
)
def test_reward_info_columns_give_every_row_every_key(values: list[Any], holes: list[bool]) -> None:
    infos = [
        {"k": values[i]} if i < len(values) and not hole else {} for i, hole in enumerate(holes)
    ]
    columns = reward_info_columns([*infos, {"reward": 1.0, "finished": True}])
    if not any("k" in info for info in infos):
        assert columns == {}
        return
    assert (
        list(columns) == ["k"] and len(columns["k"]) == len(infos) + 1
    )  # reward/finished are the ledger's
    present = [info["k"] for info in infos if "k" in info]
    fill = default_for(present)
    for info, value in zip(infos, columns["k"]):
        assert value == (info["k"] if "k" in info else fill) or (
            value != value and info["k"] != info["k"]
        )
    kinds = {type(v) for v in present if v is not None}
    if kinds and kinds <= {int, float}:
        assert fill == 0.0
    elif kinds == {bool}:
        assert fill is False


# ------------------------------------------------------------------ run fingerprints
async def test_a_changed_configuration_is_refused_naming_what_changed(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url, run="r", config={"lr": 1e-6, "model": "m"}) as ledger:
        await ledger.run_session(
            _runner(0, ["ok"], 1.0), "s0", uid="u", session_index=0, group_size=1, partition="val"
        )
    async with Ledger.open(
        sqlite_url, run="r", config={"lr": 1e-6, "model": "m"}
    ) as ledger:  # the same: accepted
        await ledger.run_session(
            _runner(1, ["ok"], 1.0), "s1", uid="v", session_index=0, group_size=1, partition="val"
        )
    with pytest.raises(RunConfigMismatch) as refused:
        async with Ledger.open(
            sqlite_url,
            run="r",
            config={"lr": 2e-6, "model": "m"},
            metric_policy=MetricPolicy(rules={"val": {"infra": "exclude"}}),
        ):
            pass
    message = str(refused.value)
    assert (
        "user.lr: 1e-06 -> 2e-06" in message
        and 'metrics.rules: {} -> {"val": {"infra": "exclude"}}' not in message
    )
    assert (
        "metrics.rules.val.infra" in message
        and "resume='new-config'" in message
        and "model" not in message
    )
    # a ledger without `config` is checked at its first session: refused before anything is written
    async with Ledger.open(sqlite_url, run="r", min_valid=3) as ledger:
        before = await ledger.store.last_position()
        with pytest.raises(RunConfigMismatch, match="min_valid: 2 -> 3"):
            await ledger.create_session(
                "s2", uid="w", session_index=0, group_size=1, partition="val"
            )
        assert await ledger.store.last_position() == before
    async with Ledger.open(
        sqlite_url, run="r", config={"lr": 2e-6, "model": "m"}, resume="new-config"
    ) as ledger:
        stored = [ev.decode(s).event for s in await ledger.store.read_stream("@run:r")]
    assert [type(e).__name__ for e in stored] == ["RunConfigured", "RunConfigured"]
    assert stored[0].change is None and stored[1].change is not None
    assert stored[1].change["previous"] == stored[0].digest and stored[1].change["changed"] == [
        "user.lr: 1e-06 -> 2e-06"
    ]
    async with Ledger.open(
        sqlite_url, run="r", config={"lr": 2e-6, "model": "m"}
    ) as ledger:  # the new one now stands
        await ledger.run_session(
            _runner(2, ["ok"], 1.0), "s3", uid="x", session_index=0, group_size=1, partition="val"
        )
    with pytest.raises(ValueError, match="resume"):
        Ledger(ledger.engine, resume="yes")


def test_a_session_id_cannot_take_a_run_stream_name() -> None:
    from sessions.errors import InvalidInput
    from sessions.validation import check_identity

    with pytest.raises(InvalidInput, match="@run:"):
        check_identity(
            "@run:x",
            run="r",
            uid="u",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=0,
        )


# ------------------------------------------------------------------ through verl (the verl_env job)
@pytest.mark.verl_env
async def test_cp_sized_placeholders_through_verls_loss_and_metrics(
    verl_installed: None, sqlite_url: str
) -> None:
    """Placeholders of 4 + 4 tokens (2·tp·cp for tp = cp = 2) through verl 0.9.1's own GRPO, worker
    loss (THD-unpadded, as context parallelism runs it) and data metrics: every token attended, no
    gradient, and a zero in the score mean."""
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    from sessions import to_data_proto
    from tests.integrations.verl.test_training import grpo, worker_loss

    policy = PlaceholderPolicy(prompt_length=4, response_length=4)
    async with Ledger.open(sqlite_url, placeholder_policy=policy) as ledger:
        for k, (plan, reward) in enumerate(
            ((["ok"], 1.0), (["runner"], 0.0), (["ok"], 0.5), (["sandbox"], 0.0))
        ):
            await ledger.run_session(
                _runner(k, plan, reward),
                f"cp{k}",
                uid="cp",
                session_index=k,
                group_size=4,
                partition="train",
                global_step=0,
            )
        batch = await ledger.batch("train", 0, timeout=10)
    dp = grpo(to_data_proto(batch))
    placeholder = dp.batch["is_placeholder"]
    assert int(placeholder.sum()) == 2
    assert (dp.batch["attention_mask"][placeholder].sum(-1) == 8).all() and not dp.batch[
        "response_mask"
    ][placeholder].any()
    assert (
        not dp.batch["advantages"][placeholder].any()
        and dp.batch["advantages"][~placeholder].abs().sum() > 0
    )

    size, width = len(dp), dp.batch["attention_mask"].shape[1]
    dp.batch["old_log_probs"] = torch.zeros_like(dp.batch["rm_scores"])
    # the whole batch on one rank; then two ranks, one of which holds only the placeholders (its
    # micro-batch is fully masked: finite because the mini-batch's token count is global)
    real, fake = torch.nonzero(~placeholder).flatten(), torch.nonzero(placeholder).flatten()
    for rows, ranks in (([torch.arange(size)], 1), ([real, fake], 2)):
        leaf = (
            -torch.rand((size, width), generator=torch.Generator().manual_seed(7))
        ).requires_grad_(True)
        loss = worker_loss(dp, leaf, rows, mode="token-mean", global_batch_size=size, dp_size=ranks)
        assert torch.isfinite(loss), f"loss {loss} over rows {rows}"
        loss.backward()
        assert leaf.grad is not None and not leaf.grad[placeholder].any(), (
            "a placeholder moved the gradient"
        )
    metrics = compute_data_metrics(batch=dp, use_critic=False)
    assert metrics["critic/score/mean"] == pytest.approx(
        (1.0 + 0.0 + 0.5 + 0.0) / 4
    )  # the failures count as zeros
