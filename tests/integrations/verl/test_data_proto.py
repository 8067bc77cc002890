"""sessions.integrations.verl against verl 0.9.1's own code, on batches recorded through the
public API (both backends): conversion, GRPO statistics (V0 every row, V1 each session's last
row), compute_data_metrics, DataProto operations and RayPPOTrainer._balance_batch.

Each hypothesis example records a train and a val step (failures, timeouts, cancellations, a
drop policy, sessions of several rows) into a run of its own in a module-scoped database.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions.batches import non_tensor
from sessions.batches.advantage import grpo_outcome_advantage
from sessions.integrations.verl import GROUP_UID, IS_PADDING, to_data_proto, without_padding
from tests.integrations.verl.scenarios import (
    ledger_figure,
    new_run,
    plans,
    recorded_batches,
    verl_v1_utils,
)

pytestmark = pytest.mark.verl_env

EXAMPLES = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ------------------------------------------------------------------------------ helpers
def signatures(dp: Any) -> dict[str, tuple[Any, ...]]:
    """key -> what the row's tensors and non-tensor columns hold: equal iff the row is intact."""
    b, nt = dp.batch, dp.non_tensor_batch
    weights = torch.arange(1, b["input_ids"].shape[1] + 1)
    checksum = (b["input_ids"] * weights).sum(-1) + 7 * (b["attention_mask"] * weights).sum(-1)
    out: dict[str, tuple[Any, ...]] = {}
    for i, key in enumerate(nt["key"].tolist()):
        out[key] = (
            nt["uid"][i],
            nt["session_id"][i],
            float(b["rm_scores"][i].sum()),
            int(b["response_mask"][i].sum()),
            int(checksum[i]),
            bool(b["is_placeholder"][i]),
            float(b["response_length"][i]),
        )
    return out


def assert_aligned(dp: Any, reference: dict[str, tuple[Any, ...]]) -> None:
    got = signatures(dp)
    assert len(got) == len(dp), "keys repeated within a DataProto"
    for key, signature in got.items():
        assert signature == reference[key], key


def with_grpo(dp: Any) -> Any:
    """What a trainer does before its metrics: verl's GRPO on rm_scores (in place)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    dp.batch["token_level_scores"] = dp.batch["rm_scores"]
    dp.batch["token_level_rewards"] = dp.batch["rm_scores"]
    advantages, returns = compute_grpo_outcome_advantage(
        dp.batch["token_level_rewards"], dp.batch["response_mask"], dp.non_tensor_batch["uid"]
    )
    dp.batch["advantages"], dp.batch["returns"] = advantages, returns
    return dp


def last_row_reference(batch: Any) -> torch.Tensor:
    """verl V1's rule from the ledger's reference: GRPO over each session's final row (highest
    index of key {uid}_{session_index}_{i}), placeholders excluded, broadcast to the session."""
    keys = non_tensor(batch, "key")
    session = [key.rsplit("_", 1)[0] for key in keys]
    final: dict[str, int] = {}
    for i, key in enumerate(keys):
        if session[i] not in final or int(key.rsplit("_", 1)[1]) > int(
            keys[final[session[i]]].rsplit("_", 1)[1]
        ):
            final[session[i]] = i
    rows = sorted(final.values())
    sub = batch[torch.tensor(rows)]
    advantage = grpo_outcome_advantage(sub, exclude_placeholders=True, min_valid=1)
    mask = sub["response_mask"].sum(-1)
    scalar = torch.where(
        mask > 0, advantage.sum(-1) / mask.clamp(min=1), torch.zeros_like(mask, dtype=torch.float32)
    )
    by_session = {session[row]: scalar[j] for j, row in enumerate(rows)}
    per_row = torch.stack([by_session[s] for s in session])
    return per_row.unsqueeze(-1) * batch["response_mask"]


@pytest.fixture(scope="module")
def recorded(module_db_url: str) -> Iterator[Any]:
    """Record (partition, step, plan)s into a new run; returns their batches and metrics."""

    def record(*steps: tuple[str, int, list[Any]]) -> tuple[list[Any], list[Any]]:
        return asyncio.run(recorded_batches(module_db_url, new_run("vi"), list(steps)))

    yield record


# ------------------------------------------------------------------------------ tests
def test_imports_without_verl_and_names_the_extra() -> None:
    """The adapter imports with verl absent; a call that needs verl says how to install it."""
    code = (
        "import sys; sys.modules['verl'] = None\n"
        "import sessions.integrations.verl as v\n"
        "import numpy as np\n"
        "from sessions.batches import BatchRow, build_padded\n"
        "one = np.ones(1, dtype=np.int32)\n"
        "batch = build_padded([BatchRow(one, one, one.astype(np.uint8), None, 1.0, False, {'uid': 'u'})])\n"
        "try:\n    v.to_data_proto(batch)\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "ERR" in out.stdout and "[verl]" in out.stdout, out.stdout + out.stderr


@EXAMPLES
@given(plan_train=plans(), plan_val=plans())
def test_conversion_grpo_and_metrics_match_verl(
    verl_installed: None, recorded: Any, plan_train: list[Any], plan_val: list[Any]
) -> None:
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    (train, val), (train_metrics, val_metrics) = recorded(
        ("train", 0, plan_train), ("val", 0, plan_val)
    )
    for batch, metrics, partition in ((train, train_metrics, "train"), (val, val_metrics, "val")):
        size = batch.batch_size[0]
        stock = DataProto.from_tensordict(batch)  # the one-liner: no glue at all
        dp = to_data_proto(batch)
        placeholder = batch["is_placeholder"].numpy()
        # conversion: tensors as they are, non-tensor columns as 1-D object arrays, nothing in meta_info
        assert dp.meta_info == {} and stock.meta_info == {}
        assert set(dp.batch.keys()) == set(stock.batch.keys()) | {IS_PADDING}
        for key in stock.batch.keys():
            assert dp.batch[key].dtype == stock.batch[key].dtype and torch.equal(
                dp.batch[key], stock.batch[key]
            )
        assert not dp.batch[IS_PADDING].any()
        assert set(dp.non_tensor_batch) == set(stock.non_tensor_batch) | {GROUP_UID}
        for key, values in dp.non_tensor_batch.items():
            assert values.dtype == object and values.shape == (size,), key
            if key not in ("uid", GROUP_UID):
                assert (
                    values.tolist()
                    == stock.non_tensor_batch[key].tolist()
                    == non_tensor(batch, key)
                )
        uids = non_tensor(batch, "uid")
        assert dp.non_tensor_batch[GROUP_UID].tolist() == uids
        isolated = dp.non_tensor_batch["uid"]
        if partition == "val":  # validation groups by uid: never isolated by default
            assert isolated.tolist() == uids
        else:
            for i in range(size):
                expected = (
                    f"{uids[i]}-ph{non_tensor(batch, 'session_index')[i]}"
                    if placeholder[i]
                    else uids[i]
                )
                assert isolated[i] == expected and "_" not in isolated[i]
            isolated_groups = set(isolated[placeholder].tolist())
            assert len(isolated_groups) == placeholder.sum() and not isolated_groups & set(uids)

        # V0 GRPO, every row: stock verl == the ledger's reference (placeholders out with isolation)
        train_dp = to_data_proto(batch, isolate_placeholders=True)
        for proto, exclude in ((train_dp, True), (stock, False)):
            advantage, _ = compute_grpo_outcome_advantage(
                proto.batch["rm_scores"],
                proto.batch["response_mask"],
                proto.non_tensor_batch["uid"],
            )
            reference = grpo_outcome_advantage(
                batch, exclude_placeholders=exclude, min_valid=1
            )  # verl: a lone row keeps its score
            torch.testing.assert_close(advantage, reference, rtol=1e-5, atol=2e-5)
            assert not advantage[torch.from_numpy(placeholder)].any()  # exactly 0

        # V1 GRPO, each session's last row (trainer_base._compute_advantage), keys as the ledger writes them
        v1_input = to_data_proto(batch, isolate_placeholders=True)
        v1_input.batch["token_level_rewards"] = v1_input.batch[
            "rm_scores"
        ]  # as trainer_base does first
        v1 = verl_v1_utils().compute_advantage_for_multi_trajectories(
            v1_input,
            batch_keys=list(train_dp.non_tensor_batch["key"]),
            adv_estimator="grpo",
        )
        torch.testing.assert_close(
            v1.batch["advantages"], last_row_reference(batch), rtol=1e-5, atol=2e-5
        )

        # compute_data_metrics on the batch as exported, after GRPO: critic/score/mean is the ledger's reward/mean
        for proto in (stock, dp):
            figures = compute_data_metrics(with_grpo(proto), use_critic=False)
            assert figures["critic/score/mean"] == pytest.approx(
                ledger_figure(metrics, "reward/mean"), abs=1e-6
            )
            assert (
                figures["response/aborted_ratio"] == 0.0
            )  # a placeholder has one attended response token


@EXAMPLES
@given(plan_train=plans(), plan_val=plans(), dp_size=st.sampled_from([1, 2, 4]))
def test_dataproto_operations_and_balance_batch_keep_rows_aligned(
    verl_installed: None, recorded: Any, plan_train: list[Any], plan_val: list[Any], dp_size: int
) -> None:
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    (train, val), _ = recorded(("train", 0, plan_train), ("val", 0, plan_val))
    dp = to_data_proto(train, pad_to_multiple=dp_size)
    reference = signatures(dp)
    assert len(dp) % dp_size == 0

    chunks = dp.chunk(dp_size)
    assert [len(c) for c in chunks] == [len(dp) // dp_size] * dp_size
    for part in chunks + dp.split(3) + [dp[::2], dp[np.arange(len(dp))[::-1].copy()]]:
        assert_aligned(part, reference)
    assert_aligned(DataProto.concat(chunks), reference)
    assert list(DataProto.concat(chunks).non_tensor_batch["key"]) == list(
        dp.non_tensor_batch["key"]
    )

    extra = DataProto.from_dict(tensors={"values": torch.arange(len(dp), dtype=torch.float32)})
    joined = dp.union(extra)
    assert_aligned(joined, reference)

    # RayPPOTrainer._balance_batch, called as the trainer calls it: it needs the actor's dp size only
    trainer = types.SimpleNamespace(
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))}),
        use_prefix_grouper=False,
    )
    trainer._get_dp_size = types.MethodType(RayPPOTrainer._get_dp_size, trainer)
    order_before = dp.non_tensor_batch["key"].tolist()
    metrics: dict[str, Any] = {}
    RayPPOTrainer._balance_batch(trainer, joined, metrics=metrics)
    assert sorted(joined.non_tensor_batch["key"].tolist()) == sorted(order_before)
    assert_aligned(joined, reference)
    # the values column travelled with its rows
    position = {key: i for i, key in enumerate(order_before)}
    expected_values = [float(position[key]) for key in joined.non_tensor_batch["key"].tolist()]
    assert joined.batch["values"].tolist() == expected_values
    assert any(name.startswith("global_seqlen/") for name in metrics)
    assert_aligned(without_padding(joined), reference)
    assert not without_padding(joined).batch[IS_PADDING].any()


@EXAMPLES
@given(plan_0=plans(), plan_1=plans(), multiple=st.sampled_from([1, 4, 8]))
def test_fixed_widths_let_two_steps_concatenate(
    verl_installed: None, recorded: Any, plan_0: list[Any], plan_1: list[Any], multiple: int
) -> None:
    """Two steps padded to verl's fixed widths (and a multiple) concatenate with rows intact; their
    groups, placeholders and filler rows keep uids of their own; verl's GRPO on the concatenation
    equals it on each step alone."""
    from verl.protocol import DataProto

    from sessions.batches import BatchTooLongError

    (first, second), _ = recorded(("train", 0, plan_0), ("train", 1, plan_1))
    widths = {
        "prompt_width": 12,
        "response_width": 16,
    }  # the scenarios' rows are at most 8 + 11 tokens
    steps = [to_data_proto(b, pad_to_multiple=multiple, **widths) for b in (first, second)]
    for dp in steps:
        assert dp.batch["prompts"].shape[1] == 12 and dp.batch["responses"].shape[1] == 16
        assert dp.batch["input_ids"].shape[1] == 28
    both = DataProto.concat(steps)
    assert_aligned(both, signatures(steps[0]) | signatures(steps[1]))
    assert not set(steps[0].non_tensor_batch["uid"].tolist()) & set(
        steps[1].non_tensor_batch["uid"].tolist()
    )
    together = with_grpo(both).batch["advantages"]
    alone = torch.cat([with_grpo(dp).batch["advantages"] for dp in steps])
    torch.testing.assert_close(together, alone, rtol=0, atol=0)
    unpadded = [to_data_proto(b) for b in (first, second)]
    if unpadded[0].batch["responses"].shape[1] != unpadded[1].batch["responses"].shape[1]:
        with pytest.raises(RuntimeError):  # each export's own widths: what fixed widths are for
            DataProto.concat(unpadded)
    with pytest.raises(BatchTooLongError):
        to_data_proto(first, prompt_width=0, response_width=16)


@EXAMPLES
@given(plan_train=plans())
def test_columns_a_verl_step_reads_are_there(
    verl_installed: None, recorded: Any, plan_train: list[Any]
) -> None:
    """num_turns (V1), __num_turns__ (compute_data_metrics' num_turns/*) and multi_modal_inputs
    (RayPPOTrainer.fit reads it unconditionally) reach the DataProto, filler rows included."""
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    (batch,), _ = recorded(("train", 0, plan_train))
    dp = to_data_proto(batch, pad_to_multiple=8)
    size = batch.batch_size[0]
    turns = dp.batch["num_turns"]
    assert turns.dtype == torch.int64
    assert dp.non_tensor_batch["__num_turns__"].tolist() == turns.tolist()
    assert not turns[size:].any() and not turns[:size][batch["is_placeholder"]].any()
    assert (turns[:size][~batch["is_placeholder"]] >= 1).all()
    images = []  # RayPPOTrainer.fit, verbatim in what it reads
    for multi_modal_input in dp.non_tensor_batch["multi_modal_inputs"]:
        if "image_grid_thw" not in multi_modal_input.keys():
            continue
        images.extend(multi_modal_input["images_seqlens"].tolist())
    assert images == []
    figures = compute_data_metrics(with_grpo(without_padding(dp)), use_critic=False)
    real_turns = turns[:size].double()
    assert figures["num_turns/mean"] == pytest.approx(float(real_turns.mean()))
    assert figures["num_turns/max"] == int(real_turns.max()) and figures["num_turns/min"] == int(
        real_turns.min()
    )
