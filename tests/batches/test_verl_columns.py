"""The columns a verl 0.9.1 step reads, in every layout: float32 lengths, num_turns and
__num_turns__, multi_modal_inputs (issue #14 items 1 and 8), and the dtypes columns.py declares.

The verl tests run verl's own code on the batch as built (``verl_installed``: skipped without
verl on a developer machine, required in the verl-pins job).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions.batches import (
    COLUMN_DTYPES,
    MAX_EXACT_LENGTH,
    NON_TENSOR_COLUMNS,
    UNKNOWN_TURNS,
    BatchRow,
    build_jagged,
    build_padded,
    concat_batches,
    concat_padded,
    densify,
    from_plain_dict,
    non_tensor,
    pad_to_widths,
    select_rows,
    split_batch,
    to_plain_dict,
)
from sessions.batches.flat import lengths_as_index
from tests.batches.strategies import assert_declared_columns, assert_same_batch, rows

pytestmark = pytest.mark.verl_env

EXAMPLES = settings(max_examples=30, deadline=None)


def weights_only_roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def row(
    prompt: int, response: int, *, key: str = "k_0_0", placeholder: bool = False, **meta: Any
) -> BatchRow:
    ids = np.ones(response, np.int32)
    return BatchRow(
        np.ones(prompt, np.int32),
        ids,
        np.zeros(response, np.uint8),
        None,
        1.0,
        placeholder,
        {"key": key, **meta},
    )


# ------------------------------------------------------------------------------ every layout
@EXAMPLES
@given(batch_rows=rows(), data=st.data())
def test_every_layout_has_the_declared_columns_and_dtypes(
    batch_rows: list[BatchRow], data: Any
) -> None:
    padded, jagged = build_padded(batch_rows), build_jagged(batch_rows)
    n = len(batch_rows)
    index = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []
    picked = [batch_rows[i] for i in index]
    layouts = {
        "padded": (padded, batch_rows),
        "jagged": (jagged, batch_rows),
        "densify": (densify(jagged), batch_rows),
        "concat_padded": (concat_padded([jagged, padded]), batch_rows + batch_rows),
        "pad_to_widths": (pad_to_widths(padded, 13, 13), batch_rows),
        "plain padded": (
            from_plain_dict(weights_only_roundtrip(to_plain_dict(padded))),
            batch_rows,
        ),
        "plain jagged": (
            from_plain_dict(weights_only_roundtrip(to_plain_dict(jagged))),
            batch_rows,
        ),
        "select padded": (select_rows(padded, index), picked),
        "select jagged": (select_rows(jagged, index), picked),
        "concat jagged": (concat_batches([jagged, jagged]), batch_rows + batch_rows),
        "split jagged": (split_batch(jagged, 3)[0], batch_rows[:3]),
    }
    for name, (batch, expected_rows) in layouts.items():
        try:
            assert_declared_columns(batch, expected_rows, batch_rows)
        except AssertionError as error:
            raise AssertionError(f"layout {name}: {error}") from error
    assert_same_batch(densify(jagged), padded)


@EXAMPLES
@given(batch_rows=rows())
def test_plain_dict_holds_float32_lengths_and_loads_weights_only(
    batch_rows: list[BatchRow],
) -> None:
    for batch in (build_padded(batch_rows), build_jagged(batch_rows)):
        plain = weights_only_roundtrip(to_plain_dict(batch))
        for name in ("prompt_length", "response_length"):
            assert plain[name].dtype == torch.float32, name
        assert plain["num_turns"].dtype == torch.int64
        assert plain["prompt_length"].tolist() == [len(r.prompt_ids) for r in batch_rows]
        assert plain["multi_modal_inputs"] == [{} for _ in batch_rows]
        assert plain["__num_turns__"] == plain["num_turns"].tolist()
        assert set(NON_TENSOR_COLUMNS) <= set(plain)


# ------------------------------------------------------------------------------ num_turns
@EXAMPLES
@given(batch_rows=rows())
def test_num_turns_is_the_meta_value_else_0_for_placeholders_else_unknown(
    batch_rows: list[BatchRow],
) -> None:
    expected = [
        r.meta["num_turns"] if "num_turns" in r.meta else 0 if r.is_placeholder else UNKNOWN_TURNS
        for r in batch_rows
    ]
    for batch in (build_padded(batch_rows), build_jagged(batch_rows)):
        assert batch.get("num_turns").tolist() == expected
        assert non_tensor(batch, "__num_turns__") == expected
        assert all(type(v) is int for v in non_tensor(batch, "__num_turns__"))


def test_num_turns_survive_relayout_and_a_batch_without_them_gets_the_default() -> None:
    batch_rows = [
        row(2, 3, key="a_0_0", num_turns=4),
        row(1, 1, key="b_0_0", placeholder=True),
        row(1, 2, key="c_0_0"),
    ]
    padded = build_padded(batch_rows)
    assert padded.get("num_turns").tolist() == [4, 0, UNKNOWN_TURNS]
    assert densify(build_jagged(batch_rows)).get("num_turns").tolist() == [4, 0, UNKNOWN_TURNS]
    older = padded.exclude("num_turns", "__num_turns__")  # a batch from before the column existed
    relaid = concat_padded([older])
    assert relaid.get("num_turns").tolist() == [UNKNOWN_TURNS, 0, UNKNOWN_TURNS]
    assert non_tensor(relaid, "__num_turns__") == [UNKNOWN_TURNS, 0, UNKNOWN_TURNS]


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True])
def test_meta_num_turns_must_be_a_count(bad: Any) -> None:
    with pytest.raises(ValueError, match="bad_0_0.*num_turns"):
        build_padded(
            [row(1, 1, key="ok_0_0", num_turns=1), row(1, 1, key="bad_0_0", num_turns=bad)]
        )


# ------------------------------------------------------------------------------ multi_modal_inputs
def test_multi_modal_inputs_are_one_fresh_dict_per_row() -> None:
    batch = build_padded([row(1, 1, key=f"k{i}_0_0") for i in range(3)])
    dicts = non_tensor(batch, "multi_modal_inputs")
    assert dicts == [{}, {}, {}] and len({id(d) for d in dicts}) == 3
    dicts[0]["image_grid_thw"] = 1  # a trainer writing one row's dict leaves the others alone
    assert non_tensor(batch, "multi_modal_inputs")[1:] == [{}, {}]


def test_multi_modal_inputs_of_a_batch_are_kept_through_relayout() -> None:
    batch = build_jagged([row(1, 2, key="a_0_0"), row(2, 1, key="b_0_0")])
    given_inputs = [{"pixel_values": torch.ones(2)}, {}]
    batch.set("multi_modal_inputs", __import__("tensordict").NonTensorStack.from_list(given_inputs))
    for out in (
        densify(batch),
        pad_to_widths(batch, 4, 4),
        select_rows(batch, [1, 0]),
        concat_padded([batch, build_jagged([])]),
    ):
        got = non_tensor(out, "multi_modal_inputs")
        expected = (
            given_inputs if len(got) == 2 and "pixel_values" in got[0] else given_inputs[::-1]
        )
        assert [sorted(d) for d in got] == [sorted(d) for d in expected]
    assert non_tensor(
        concat_padded([batch.exclude("multi_modal_inputs"), batch]), "multi_modal_inputs"
    )[:2] == [{}, {}]


# ------------------------------------------------------------------------------ float32 lengths
@pytest.mark.parametrize("builder", [build_padded, build_jagged])
def test_a_row_longer_than_float32_counts_exactly_is_refused(builder: Any) -> None:
    huge = np.broadcast_to(np.int32(1), (MAX_EXACT_LENGTH + 1,))  # no memory: one element, stride 0
    ok = row(1, 1, key="ok_0_0")
    long = BatchRow(
        huge, np.ones(1, np.int32), np.zeros(1, np.uint8), None, 0.0, False, {"key": "long_0_0"}
    )
    with pytest.raises(ValueError, match=r"'long_0_0'.*prompt_length 16777217 exceeds 16777216"):
        builder([ok, long])
    exact = float(np.float32(MAX_EXACT_LENGTH))
    assert (
        exact == MAX_EXACT_LENGTH
        and float(np.float32(MAX_EXACT_LENGTH + 1)) != MAX_EXACT_LENGTH + 1
    )


def test_lengths_read_back_as_int64_and_bad_ones_are_refused() -> None:
    assert lengths_as_index(torch.tensor([0.0, 3.0]), "prompt_length").dtype == torch.int64
    assert lengths_as_index(torch.tensor([2, 5]), "prompt_length").tolist() == [2, 5]
    for bad in (
        torch.tensor([1.5]),
        torch.tensor([-1.0]),
        torch.tensor([float("inf")]),
        torch.tensor([-2]),
    ):
        with pytest.raises(ValueError, match="prompt_length"):
            lengths_as_index(bad, "prompt_length")


def test_an_export_with_int64_lengths_loads_as_float32() -> None:
    batch = build_padded([row(2, 3, key="a_0_0"), row(1, 1, key="b_0_0")])
    plain = to_plain_dict(batch)
    old = {
        **plain,
        "prompt_length": plain["prompt_length"].long(),
        "response_length": plain["response_length"].long(),
    }
    loaded = from_plain_dict(weights_only_roundtrip(old))
    assert loaded.get("prompt_length").dtype == torch.float32
    assert_same_batch(loaded, batch)


def test_to_plain_dict_refuses_values_weights_only_cannot_load() -> None:
    batch = build_padded([row(1, 1)])
    batch.set(
        "multi_modal_inputs", __import__("tensordict").NonTensorStack.from_list([{"x": object()}])
    )
    with pytest.raises(TypeError, match="multi_modal_inputs"):
        to_plain_dict(batch)


# ------------------------------------------------------------------------------ verl's own code
def _as_verl_step(batch: Any) -> Any:
    """DataProto.from_tensordict (the documented no-glue path) plus what a step adds before metrics."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    dp = DataProto.from_tensordict(batch)
    dp.batch["token_level_scores"] = dp.batch["rm_scores"]
    dp.batch["token_level_rewards"] = dp.batch["rm_scores"]
    dp.batch["advantages"], dp.batch["returns"] = compute_grpo_outcome_advantage(
        dp.batch["token_level_rewards"], dp.batch["response_mask"], dp.non_tensor_batch["uid"]
    )
    return dp


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch_rows=rows(min_size=1))
def test_verl_compute_data_metrics_runs_on_the_batch(
    verl_installed: None, batch_rows: list[BatchRow]
) -> None:
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    batch = build_padded(batch_rows)
    metrics = compute_data_metrics(_as_verl_step(batch), use_critic=False)
    prompt_lengths = [len(r.prompt_ids) for r in batch_rows]
    assert metrics["prompt_length/mean"] == pytest.approx(np.mean(prompt_lengths))
    assert metrics["response_length/max"] == max(len(r.response_ids) for r in batch_rows)
    turns = batch.get("num_turns").tolist()
    assert (metrics["num_turns/min"], metrics["num_turns/max"]) == (min(turns), max(turns))
    assert metrics["num_turns/mean"] == pytest.approx(np.mean(turns))


def test_verl_reads_multi_modal_inputs_and_num_turns_as_its_trainers_do(
    verl_installed: None,
) -> None:
    from verl import DataProto

    batch = build_padded(
        [row(2, 3, key="a_0_0", num_turns=2), row(1, 1, key="b_0_0", placeholder=True)]
    )
    dp = DataProto.from_tensordict(batch)
    # RayPPOTrainer.fit (verl/trainer/ppo/ray_trainer.py, ~line 1556) reads it unconditionally:
    images_seqlens_all: list[int] = []
    for multi_modal_input in dp.non_tensor_batch["multi_modal_inputs"]:
        if "image_grid_thw" not in multi_modal_input.keys():
            continue
        images_seqlens_all.extend(multi_modal_input["images_seqlens"].tolist())
    assert images_seqlens_all == []
    assert dp.non_tensor_batch["multi_modal_inputs"].dtype == object
    assert dp.non_tensor_batch["__num_turns__"].tolist() == [2, 0]
    assert dp.batch["num_turns"].tolist() == [2, 0]  # the V1 trainer's column
    assert (
        dp.batch["prompt_length"].dtype
        == dp.batch["response_length"].dtype
        == COLUMN_DTYPES["prompt_length"]
    )
    chunks = dp.chunk(2)  # DataProto ops keep the new columns aligned
    assert [c.non_tensor_batch["__num_turns__"].tolist() for c in chunks] == [[2], [0]]
