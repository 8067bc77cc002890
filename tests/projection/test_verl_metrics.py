"""Metrics in verl's names are verl's (docs/design.md §7).

`sessions.projection.verl_metrics` against verl 0.9.1's own code, and the ledger's
`reward/mean@k` against verl's `val-core/<ds>/reward/mean@k` on the rows of the ledger's batch:

* hypothesis steps (data sources, uids, rows per uid, uids that lost rows, rewards, turns): the
  dict equals `RayPPOTrainer._val_metrics_update(process_validation_metrics(...))` key for key;
  the training figures equal `compute_data_metrics`' on a DataProto of the same rows;
* sessions recorded through the public `Ledger` on both backends (failures, cancellations, a
  drop policy, trajectory selection `all` with several trajectories per session): the stored
  `reward/mean@k` of every scope equals verl's on the batch (`rm_scores.sum(-1)`, `uid`,
  `data_source`), and the functions fed with the step's queue rows equal verl on the batch.

verl's `ray_trainer` module does not import under verl's pins without its `verl-core` extra
(cachetools, uvicorn, ...), so `_val_metrics_update` is taken from verl's installed source and
run as verl wrote it (it uses nothing of `self`). Tests without verl pin the semantics by hand.
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, PlaceholderPolicy, SandboxError
from sessions.errors import InvalidInput
from sessions.projection import verl_metrics as vm
from sessions.projection.metrics import MetricRow
from store import read_models as rm
from tests.conftest import backend_of, require_verl

pytestmark = pytest.mark.verl_env

SOURCES = ("gsm8k", "math", "swe-lite", None)
TOLERANCE = {"rel": 1e-9, "abs": 1e-12}


# ------------------------------------------------------------------------------ verl's own code
@pytest.fixture(scope="module")
def verl_val() -> Callable[..., dict[str, Any]]:
    """verl's own `RayPPOTrainer._val_metrics_update(self, data_sources, sample_uids,
    reward_extra_infos_dict, sample_turns)` (it uses nothing of `self`)."""
    require_verl()
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    update = RayPPOTrainer._val_metrics_update

    def run(
        data_sources: list[Any],
        uids: list[Any],
        scores: list[float],
        turns: list[int] | None = None,
    ) -> dict[str, Any]:
        sample_turns = [] if turns is None else [np.array(turns, dtype=np.int32)]
        return update(
            None,
            np.array(data_sources, dtype=object),
            list(uids),
            {"reward": list(scores)},
            sample_turns,
        )

    return run


def assert_same(
    mine: dict[str, float], verl: dict[str, Any], tolerance: dict[str, float] = TOLERANCE
) -> None:
    assert set(mine) == set(verl), (
        f"only ours: {sorted(set(mine) - set(verl))}; only verl's: {sorted(set(verl) - set(mine))}"
    )
    for key, value in verl.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(mine[key]), key
        else:
            assert mine[key] == pytest.approx(float(value), **tolerance), key


def f32(values: list[float]) -> list[float]:
    """What `rm_scores.sum(-1).tolist()` hands verl: each score as a float32."""
    return np.asarray(values, dtype=np.float32).astype(np.float64).tolist()


# ------------------------------------------------------------------------------ generated steps
@st.composite
def steps(draw: st.DrawFn) -> tuple[list[Any], list[str], list[float], list[int]]:
    """A step's rows in batch order: uids of 1-9 rows (a uid of n that lost rows has fewer), rows
    of different uids interleaved."""
    sources = draw(st.lists(st.sampled_from(SOURCES), min_size=1, max_size=3, unique=True))
    reward = st.one_of(
        st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(-5, 5, allow_nan=False, width=32)
    )
    rows: list[tuple[Any, str, float, int]] = []
    for u in range(draw(st.integers(1, 8))):
        source = draw(st.sampled_from(sources))
        for _ in range(draw(st.integers(1, 9))):
            rows.append((source, f"u{u}", draw(reward), draw(st.integers(0, 12))))
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps())
def test_validation_metrics_are_verls_key_for_key(
    verl_val: Callable[..., dict[str, Any]], step: Any
) -> None:
    sources, uids, scores, turns = step
    state = np.random.get_state()
    mine = vm.validation_metrics(sources, uids, scores, turns)
    assert all(
        a is b or np.array_equal(a, b) for a, b in zip(state, np.random.get_state())
    )  # the caller's RNG untouched
    assert_same(mine, verl_val(sources, uids, f32(scores), turns))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), data=st.data())
def test_data_metrics_are_compute_data_metrics(step: Any, data: st.DataObject) -> None:
    """The batch-only figures of `compute_data_metrics` on a DataProto of the same rows (response
    length 0 included: verl calls such rows aborted)."""
    require_verl()
    import torch
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    _sources, _uids, scores, turns = step
    n = len(scores)
    prompt = data.draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    response = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    widths = data.draw(
        st.tuples(st.integers(max(prompt), 12), st.integers(max(max(response), 1), 12))
    )
    score_tensor = torch.zeros(n, widths[1])
    score_tensor[:, 0] = torch.tensor(scores, dtype=torch.float32)
    dp = DataProto.from_dict(
        tensors={
            "token_level_scores": score_tensor,
            "token_level_rewards": score_tensor,
            "advantages": torch.zeros(n, widths[1]),
            "returns": torch.zeros(n, widths[1]),
            "response_mask": torch.ones(n, widths[1], dtype=torch.int64),
            "prompts": torch.zeros(n, widths[0], dtype=torch.int64),
            "responses": torch.zeros(n, widths[1], dtype=torch.int64),
            "prompt_length": torch.tensor(prompt, dtype=torch.float32),
            "response_length": torch.tensor(response, dtype=torch.float32),
        },
        non_tensors={"__num_turns__": np.array(turns, dtype=np.int32)},
    )
    verl = compute_data_metrics(dp, use_critic=False)
    mine = vm.data_metrics(
        scores, prompt, response, turns, max_prompt_length=widths[0], max_response_length=widths[1]
    )
    trainer_only = {
        k
        for k in verl
        if k.startswith(("critic/rewards/", "critic/advantages/", "critic/returns/"))
    }
    assert_same(
        mine, {k: v for k, v in verl.items() if k not in trainer_only}, {"rel": 1e-6, "abs": 1e-6}
    )


# ------------------------------------------------------------------------------ the ledger, recorded
POLICY = PlaceholderPolicy(
    rules={"val": {"sandbox_error": "drop"}, "train": {"sandbox_error": "drop"}}
)
OUTCOMES = (
    "succeed",
    "succeed",
    "succeed",
    "succeed_longest",
    "succeed_absent",
    "runner_error",
    "timeout",
    "sandbox_drop",
    "cancel",
)


async def record_step(
    ledger: Ledger, rnd: random.Random, partition: str, step: int
) -> dict[Any, int]:
    """A step of 5-8 groups over two data sources and none; returns the groups per data source."""
    groups: dict[Any, int] = defaultdict(int)
    for g in range(rnd.randint(5, 8)):
        uid, size, source = (
            f"{partition}{step}g{g}",
            rnd.choice([2, 3, 4]),
            rnd.choice(["gsm8k", "math", "math", None]),
        )
        groups[source] += 1
        for index in range(size):
            outcome = rnd.choice(OUTCOMES)
            lengths = [rnd.randint(1, 6) for _ in range(rnd.choice([1, 1, 2, 3]))]
            try:
                async with ledger.session(
                    f"{ledger.run}-{uid}-{index}",
                    uid=uid,
                    session_index=index,
                    group_size=size,
                    partition=partition,
                    global_step=step,
                    data_source=source,
                ) as s:
                    for length in lengths:
                        await s.record_trajectory(
                            prompt_ids=[1, 2, 3][: rnd.randint(1, 3)],
                            response_ids=list(range(5, 5 + length)),
                            num_turns=rnd.randint(1, 4),
                        )
                    if outcome != "succeed_absent":
                        await s.post_reward(rnd.choice([0.0, 0.25, 1.0, rnd.random()]))
                    if outcome == "runner_error":
                        raise RuntimeError("runner crashed")
                    if outcome == "timeout":
                        raise TimeoutError("too slow")
                    if outcome == "sandbox_drop":
                        raise SandboxError("sandbox died")
                    if outcome == "cancel":
                        await s.cancel("preempted")
                    elif outcome == "succeed_longest":
                        await s.complete(trajectory_selection="longest")
            except (RuntimeError, TimeoutError, SandboxError):
                pass
    return groups


def batch_rows(batch: Any) -> tuple[list[Any], list[str], list[float]]:
    """What verl reads of a ledger batch: data_source, uid and rm_scores.sum(-1) per row."""
    from sessions.batches import non_tensor

    return (
        non_tensor(batch, "data_source"),
        non_tensor(batch, "uid"),
        batch["rm_scores"].sum(-1).tolist(),
    )


def scope(rows: list[MetricRow], source: Any) -> dict[str, float]:
    return {r.metric: r.value for r in rows if r.data_source == source}


EXAMPLES = {"sqlite": 6, "postgres": 3}


def test_the_ledgers_reward_mean_at_k_is_verls_on_its_batch(
    module_db_url: str, verl_val: Callable[..., dict[str, Any]]
) -> None:
    @settings(
        max_examples=EXAMPLES[backend_of(module_db_url)],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(seed=st.integers(0, 2**32 - 1))
    def check(seed: int) -> None:
        asyncio.run(one_run(module_db_url, random.Random(seed), verl_val))

    check()


async def one_run(url: str, rnd: random.Random, verl_val: Callable[..., dict[str, Any]]) -> None:
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    async with Ledger.open(
        url, run=f"r{uuid.uuid4().hex[:10]}", placeholder_policy=POLICY
    ) as ledger:
        groups = await record_step(ledger, rnd, "val", 3)
        await record_step(ledger, rnd, "train", 3)
        val_rows, train_rows = await ledger.metrics("val", 3), await ledger.metrics("train", 3)
        val_batch, train_batch = (
            await ledger.batch("val", 3, timeout=10),
            await ledger.batch("train", 3, timeout=10),
        )
        async with ledger.engine.connect() as conn:
            val_queue = await rm.queue_rows_for(conn, ledger.run, "val", 3)
            train_queue = await rm.queue_rows_for(conn, ledger.run, "train", 3)
        widths = {
            "max_prompt_length": train_batch["prompts"].shape[1],
            "max_response_length": train_batch["responses"].shape[1],
        }
        val_dict = await ledger.metrics_dict("val", 3, timeout=10)
        train_dict = await ledger.metrics_dict("train", 3, timeout=10, **widths)

    sources, uids, scores = batch_rows(val_batch)
    by_source = verl_val(sources, uids, scores)
    everything = verl_val(
        ["*"] * len(uids), uids, scores
    )  # the ledger's all-sources scope: verl has none
    for source, verl, label in [
        *((s, by_source, s) for s in {*sources} - {None}),
        (None, everything, "*"),
    ]:
        stored = scope(val_rows, source)
        at_k = {
            name.removeprefix(f"{part}/{label}/reward/"): value
            for name, value in verl.items()
            for part in ("val-core", "val-aux")
            if name.startswith(f"{part}/{label}/reward/mean@")
        }
        assert {k.removeprefix("reward/") for k in stored if k.startswith("reward/mean@")} == set(
            at_k
        ), source
        for name, value in at_k.items():
            assert stored[f"reward/{name}"] == pytest.approx(value, abs=1e-6), (source, name)
        n_max = max(int(name.split("@")[1]) for name in at_k)
        assert f"val-core/{label}/reward/mean@{n_max}" in verl  # the headline
        per_uid: dict[str, list[float]] = defaultdict(list)
        for s, u, v in zip(sources, uids, scores):
            if source is None or s == source:
                per_uid[u].append(v)
        assert stored["reward/mean_per_uid"] == pytest.approx(
            float(np.mean([np.mean(v) for v in per_uid.values()])), abs=1e-6
        )
        settled = sum(groups.values()) if source is None else groups[source]
        assert stored["reward/uids_excluded"] == settled - sum(
            len(v) == n_max for v in per_uid.values()
        ), source

    # what the lead's metrics_dict feeds: the queue rows of the step
    assert_same(
        vm.validation_metrics(
            [q["data_source"] for q in val_queue],
            [q["uid"] for q in val_queue],
            [q["reward"] for q in val_queue],
        ),
        by_source,
    )
    # Ledger.metrics_dict: verl's validation dict as verl's V0 `_validate` builds it from this batch
    # (scores, uids, data sources, `__num_turns__`), and the ledger's own figures under ledger/
    from sessions.batches import non_tensor

    turns = non_tensor(val_batch, "__num_turns__")
    assert_same(
        {k: v for k, v in val_dict.items() if not k.startswith("ledger/")},
        verl_val(sources, uids, scores, turns),
        {"rel": 1e-6, "abs": 1e-6},
    )
    # beside them, what the step's failures cost (tests/projection/test_costs.py checks those)
    assert any("/all/cost/" in k for k in val_dict) and any("/all/cost/" in k for k in train_dict)
    val_dict = {k: v for k, v in val_dict.items() if "/all/cost/" not in k}
    train_dict = {k: v for k, v in train_dict.items() if "/all/cost/" not in k}
    assert {k: v for k, v in val_dict.items() if k.startswith("ledger/")} == vm.ledger_metrics(
        val_rows
    )
    assert train_dict == vm.metrics_dict("train", train_queue, train_rows, **widths)
    mine = train_dict
    scores_t = train_batch["rm_scores"]
    dp = DataProto.from_dict(
        tensors={
            "token_level_scores": scores_t,
            "token_level_rewards": scores_t,
            "advantages": scores_t * 0,
            "returns": scores_t * 0,
            **{
                k: train_batch[k]
                for k in ("response_mask", "prompts", "responses", "attention_mask")
            },
            **{k: train_batch[k].float() for k in ("prompt_length", "response_length")},
        }
    )
    verl = compute_data_metrics(dp, use_critic=False)
    for key, value in mine.items():
        if not key.startswith("ledger/") and not key.startswith("num_turns/"):
            assert value == pytest.approx(verl[key], rel=1e-6, abs=1e-6), key
    assert mine["critic/score/mean"] == pytest.approx(
        scope(train_rows, None)["reward/mean"], abs=1e-6
    )
    assert mine["ledger/train/all/reward/mean"] == scope(train_rows, None)["reward/mean"]


# ------------------------------------------------------------------------------ semantics, by hand (no verl)
def test_a_uid_that_lost_a_row_leaves_the_headline_and_files_under_its_row_count() -> None:
    """Three uids of 4; u2 lost a session to cancellation (3 rows). verl's headline mean@4 covers
    u0 and u1 only; u2 is mean@3, in val-aux."""
    rows = [
        ("u0", 1.0),
        ("u0", 0.0),
        ("u0", 1.0),
        ("u0", 1.0),
        ("u1", 0.0),
        ("u1", 0.0),
        ("u1", 1.0),
        ("u1", 0.0),
        ("u2", 1.0),
        ("u2", 0.0),
        ("u2", 0.0),
    ]
    got = vm.validation_metrics(
        ["ds"] * len(rows), [u for u, _ in rows], [r for _, r in rows], [2] * len(rows)
    )
    assert got["val-core/ds/reward/mean@4"] == (0.75 + 0.25) / 2
    assert got["val-aux/ds/reward/mean@3"] == pytest.approx(1 / 3)
    assert "val-core/ds/reward/mean@3" not in got
    assert got["val-aux/ds/reward/std@4"] == pytest.approx(
        (np.std([1, 0, 1, 1]) + np.std([0, 0, 1, 0])) / 2
    )
    assert {k for k in got if k.startswith("val-core/")} == {
        "val-core/ds/reward/mean@4",
        "val-core/ds/reward/best@4/mean",
        "val-core/ds/reward/best@4/std",
    }
    assert got["val-aux/ds/reward/best@2/mean"] >= got["val-aux/ds/reward/worst@2/mean"]
    # best@2 averages over every uid with at least 2 rows (u2 too), best@4 over u0 and u1 only
    assert {k.split("/")[3] for k in got if "/best@" in k} == {"best@2", "best@3", "best@4"}
    assert (
        got["val-aux/num_turns/min"],
        got["val-aux/num_turns/max"],
        got["val-aux/num_turns/mean"],
    ) == (2, 2, 2)


def test_scores_are_read_as_the_batch_holds_them_in_float32() -> None:
    got = vm.validation_metrics(["ds"], ["u"], [0.1])
    assert got["val-core/ds/reward/mean@1"] == float(np.float32(0.1)) != 0.1
    assert (
        vm.validation_metrics(["ds"], ["u"], [0.1], as_float32=False)["val-core/ds/reward/mean@1"]
        == 0.1
    )
    assert vm.validation_metrics([], [], []) == {}


def test_data_metrics_count_rows_without_a_response_as_aborted() -> None:
    got = vm.data_metrics([1.0, 0.5, 0.0], [3, 2, 1], [4, 0, 1])
    assert (
        got["critic/score/mean"] == 0.5 and got["critic/score/min"] == 0.0
    )  # the aborted row's 0.5 is left out
    assert got["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert (
        got["response_length/mean"] == pytest.approx(5 / 3)
        and got["response_length_non_aborted/mean"] == 2.5
    )
    assert got["response_length/clip_ratio"] == pytest.approx(
        1 / 3
    )  # width defaults to the longest row, 4
    assert vm.data_metrics([], [], []) == {}
    with pytest.raises(ValueError, match="one value per batch row"):
        vm.data_metrics([1.0], [1, 2], [1])


def test_ledger_rows_render_under_their_own_prefix() -> None:
    rows = [
        MetricRow("r", "val", 2, None, "reward/mean@4", 0.45),
        MetricRow("r", "val", 2, "gsm8k", "reward/mean_per_uid", 0.4),
    ]
    assert vm.ledger_metrics(rows) == {
        "ledger/val/all/reward/mean@4": 0.45,
        "ledger/val/gsm8k/reward/mean_per_uid": 0.4,
    }
    with pytest.raises(ValueError, match="one step"):
        vm.ledger_metrics([*rows, MetricRow("r", "val", 3, None, "reward/mean", 0.1)])
    with pytest.raises(InvalidInput, match="data_source: 'all' is reserved"):
        vm.ledger_metrics([MetricRow("r", "val", 2, "all", "reward/mean", 0.1)])
    with pytest.raises(ValueError, match="all_sources= label"):
        vm.ledger_metrics([MetricRow("r", "val", 2, "*", "reward/mean", 0.1)], all_sources="*")
    assert vm.ledger_metrics(
        [MetricRow("r", "val", 2, "all", "reward/mean", 0.1)], all_sources="*"
    ) == {"ledger/val/all/reward/mean": 0.1}


def test_metrics_dict_reads_batch_rows_only() -> None:
    queue = [
        {
            "kind": "row",
            "data_source": "ds",
            "uid": "u",
            "reward": 1.0,
            "num_turns": 2,
            "prompt_len": 3,
            "response_len": 4,
        },
        {
            "kind": "row",
            "data_source": "ds",
            "uid": "u",
            "reward": 0.0,
            "num_turns": 0,
            "prompt_len": 1,
            "response_len": 1,
        },
        {
            "kind": "tag",
            "data_source": "ds",
            "uid": "u",
            "reward": None,
            "num_turns": None,
            "prompt_len": None,
            "response_len": None,
        },
    ]
    metric_rows = [MetricRow("r", "val", 0, "ds", "reward/mean@2", 0.5)]
    val = vm.metrics_dict("val", queue, metric_rows)
    assert val["val-core/ds/reward/mean@2"] == 0.5 and val["ledger/val/ds/reward/mean@2"] == 0.5
    assert val["val-aux/num_turns/max"] == 2
    train = vm.metrics_dict("train", queue, [])
    assert train["critic/score/mean"] == 0.5 and train["prompt_length/max"] == 3
    with pytest.raises(ValueError, match="partition"):
        vm.metrics_dict("test", queue, [])
