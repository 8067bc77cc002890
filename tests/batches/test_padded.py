"""Property tests of the fast padded writer: it must equal the straightforward construction.

The reference is the projection benchmark's per-row baseline (``F.pad`` per row, ``torch.stack``,
``NonTensorStack.from_list``), so these tests also keep the benchmark's baseline honest. Rows
cover what the writer special-cases: empty prompts and responses, placeholders, every id and
mask dtype the store or a caller may hand in, logprobs on none, some or all rows, pad ids other
than 0, and numpy scalars in ``meta``.
"""

from __future__ import annotations

import contextlib
import gc
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tensordict
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack

from benchmarks.projection import check_same, per_row_padded
from sessions import batches as batches_module
from sessions.batches import (
    NON_TENSOR_COLUMNS,
    BatchRow,
    build_padded,
    concat_batches,
    non_tensor,
    select_rows,
)
from sessions.batches import non_tensor_stacks as stacks_module
from sessions.batches.tensordict_compat import NATIVE_EMPTY_SELECTION
from tests.batches.strategies import same_stack

pytestmark = pytest.mark.verl_env  # also under verl's pin, tensordict 0.10.0

SETTINGS = settings(max_examples=60, deadline=None)
ID_DTYPES = (np.int32, np.int64, np.uint16, np.uint32)
MASK_DTYPES = (np.uint8, np.bool_, np.int64, np.int8)
LP_DTYPES = (np.float32, np.float64)


#: 0 often: empty prompts, empty responses and rows with neither are where padding goes wrong
LENGTHS = st.one_of(st.just(0), st.integers(0, 24))


@st.composite
def rows_strategy(draw: st.DrawFn, max_rows: int = 10) -> list[BatchRow]:
    """1..max_rows rows; hypothesis draws the shapes and kinds, a seeded rng the token values."""
    n = draw(st.integers(1, max_rows))
    logprobs_on = draw(st.sampled_from(["none", "some", "all"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for i in range(n):
        meta: dict[str, Any] = {
            "key": f"u{i % 3}_{i}_0",
            "uid": f"u{i % 3}",
            "run": "r",
            "session_index": draw(st.sampled_from([i, np.int64(i)])),  # numpy scalars become ints
            "global_step": 7,
            "partition": "train",
            "data_source": draw(st.sampled_from([None, "math"])),
        }
        if draw(st.booleans()):  # projected queue rows carry it; rows built by hand may not
            meta["num_turns"] = draw(st.integers(0, 4))
        with_lp = logprobs_on == "all" or (logprobs_on == "some" and draw(st.booleans()))
        lp_dtype = draw(st.sampled_from(LP_DTYPES))
        if draw(st.integers(0, 4)) == 0:  # docs/design.md §5 placeholder
            token = int(rng.integers(0, 1000))
            meta.update(failure_reason="timeout", materialization_reason="session_failed")
            rows.append(
                BatchRow(
                    np.asarray([token], np.int32),
                    np.asarray([token], np.int32),
                    np.zeros(1, np.uint8),
                    np.zeros(1, lp_dtype) if with_lp else None,
                    0.0,
                    True,
                    meta,
                )
            )
            continue
        p_len, r_len = draw(LENGTHS), draw(LENGTHS)
        id_dtype, mask_dtype = draw(st.sampled_from(ID_DTYPES)), draw(st.sampled_from(MASK_DTYPES))
        rows.append(
            BatchRow(
                rng.integers(0, 60_000, p_len).astype(id_dtype),
                rng.integers(0, 60_000, r_len).astype(id_dtype),
                rng.integers(0, 2, r_len).astype(mask_dtype),
                (-rng.exponential(size=r_len)).astype(lp_dtype) if with_lp else None,
                draw(st.sampled_from([0.0, 1.0, -2.5, 3.25])),
                False,
                meta,
            )
        )
    return rows


PAD_IDS = st.sampled_from([0, 1, 151_643, -1])


def assert_same_structure(expected: Any, found: Any) -> None:
    """Same keys in the same order, same entry types, contiguous torch-owned tensors."""
    assert list(found.keys()) == list(expected.keys())
    assert found.batch_size == expected.batch_size
    for key in expected.keys():
        a, b = expected.get(key), found.get(key)
        if isinstance(b, NonTensorStack):  # a ColumnStack: the same state, members made late
            assert same_stack(a, b), key
        else:
            assert type(a) is type(b), key
        if isinstance(b, torch.Tensor):
            assert b.shape == a.shape and b.dtype == a.dtype and b.is_contiguous(), key
            assert b.untyped_storage().resizable(), key  # allocated by torch, not numpy
        else:
            assert all(type(m) is NonTensorData for m in b.tensordicts), key


@SETTINGS
@given(rows=rows_strategy(), pad=PAD_IDS)
def test_build_padded_equals_per_row_baseline(rows: list[BatchRow], pad: int) -> None:
    expected, found = per_row_padded(rows, pad_token_id=pad), build_padded(rows, pad_token_id=pad)
    check_same(expected, found)
    check_same(found, expected)
    assert_same_structure(expected, found)


@contextlib.contextmanager
def direct_stacks(value: bool) -> Iterator[None]:
    """``_DIRECT_STACKS`` set to ``value`` for the block."""
    saved = stacks_module._DIRECT_STACKS
    stacks_module._DIRECT_STACKS = value
    try:
        yield
    finally:
        stacks_module._DIRECT_STACKS = saved


@SETTINGS
@given(rows=rows_strategy(), pad=PAD_IDS)
def test_direct_stacks_equal_tensordicts_own(rows: list[BatchRow], pad: int) -> None:
    """With the direct NonTensorStack build switched off, the batch is the same."""
    fast = build_padded(rows, pad_token_id=pad)
    with direct_stacks(False):
        slow = build_padded(rows, pad_token_id=pad)
    check_same(slow, fast)
    assert_same_structure(slow, fast)
    for name in NON_TENSOR_COLUMNS:
        assert same_stack(fast.get(name), slow.get(name)), name


@settings(max_examples=30, deadline=None)
@given(rows=rows_strategy(), data=st.data())
def test_rows_follow_indexing_save_and_cat_as_the_baseline(rows: list[BatchRow], data: Any) -> None:
    expected, found = per_row_padded(rows), build_padded(rows)
    n = len(rows)
    index = data.draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=2 * n))  # duplicates too
    picked = torch.tensor(index, dtype=torch.int64)
    check_same(select_rows(expected, picked), select_rows(found, picked))
    if index or NATIVE_EMPTY_SELECTION:  # tensordict 0.10.0 cannot select no rows itself
        check_same(expected[picked], found[picked])
        check_same(found[picked], select_rows(found, picked))
    i = data.draw(st.integers(0, n - 1))
    for name in NON_TENSOR_COLUMNS:
        assert found[i][name] == expected[i][name] == non_tensor(found, name)[i], name
    check_same(
        torch.cat([expected, select_rows(expected, picked)]),
        torch.cat([found, select_rows(found, picked)]),
    )
    check_same(
        torch.cat([found, select_rows(found, picked)]),
        concat_batches([found, select_rows(found, picked)]),
    )
    buf = io.BytesIO()
    torch.save(found, buf)
    buf.seek(0)
    check_same(expected, torch.load(buf, weights_only=False))


def test_rows_of_a_batch_are_independent() -> None:
    """Writing one row's non-tensor value leaves every other row (and column) alone."""
    meta = {"uid": "same", "run": "r"}
    rows = [BatchRow(np.array([1]), np.array([2]), np.array([1]), None, 1.0, False, meta)] * 3
    batch = build_padded(rows)
    batch["uid"][1] = "changed"
    assert non_tensor(batch, "uid") == ["same", "changed", "same"]
    assert non_tensor(batch, "run") == ["r"] * 3


SCALARS = st.one_of(
    st.text(max_size=3),
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.binary(max_size=2),
)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(SCALARS, max_size=6))
def test_non_tensor_stack_is_from_list(values: list[Any]) -> None:
    ours, theirs = stacks_module.non_tensor_stack(values), NonTensorStack.from_list(list(values))
    assert ours.tolist() == theirs.tolist() == values
    assert same_stack(ours, theirs)


def test_non_scalar_values_fall_back_to_from_list() -> None:
    values = ["a", ("t", 1), {"k": 1}]
    ours = stacks_module.non_tensor_stack(values)
    assert ours.tolist() == NonTensorStack.from_list(values).tolist()


def test_direct_build_is_in_use_on_the_tensordict_it_was_measured_on() -> None:
    """The fast path switches itself off on a tensordict whose objects it does not reproduce;
    on the versions it was written and measured against (the newest, and verl 0.9.1's pin,
    whose stacks name two attributes differently) it must be on."""
    assert stacks_module._DIRECT_STACKS == stacks_module._direct_build_matches()
    if tensordict.__version__ in ("0.10.0", "0.15.3"):
        assert stacks_module._DIRECT_STACKS


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_state_is_restored(enabled: bool) -> None:
    rows = [BatchRow(np.array([1]), np.array([2]), np.array([1]), None, 1.0, False, {"uid": "u"})]
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        build_padded(rows)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


@settings(max_examples=60, deadline=None)
@given(
    masks=st.lists(
        st.tuples(
            st.sampled_from(MASK_DTYPES + (np.uint64, np.int16)),
            st.lists(st.integers(-3, 3), max_size=5),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_mask_values_rejected_iff_not_binary(masks: list[tuple[Any, list[int]]]) -> None:
    """Mixed mask dtypes are checked as their int64 values, whatever numpy promotes them to."""
    rows, values = [], []
    for i, (dtype, raw) in enumerate(masks):
        mask = np.asarray(raw).astype(dtype)  # negative -> wraps for unsigned, -> True for bool
        values.append(mask.astype(np.int64))
        meta = {"key": f"row{i}"}
        rows.append(BatchRow(np.array([1]), np.arange(len(raw)), mask, None, 0.0, False, meta))
    bad = [i for i, v in enumerate(values) if ((v != 0) & (v != 1)).any()]
    if not bad:
        build_padded(rows)
        return
    with pytest.raises(ValueError, match=rf"'row{bad[0]}'.*0 or 1"):
        build_padded(rows)


def test_relayout_leaves_the_input_batches_as_they_were() -> None:
    """densify/concat_padded read their inputs through views that leave the storage resizable."""
    rows = [
        BatchRow(np.array([1, 2]), np.array([3]), np.array([1]), None, 1.0, False, {"uid": "a"}),
        BatchRow(np.array([4]), np.array([5, 6]), np.array([0, 1]), None, 2.0, False, {"uid": "b"}),
    ]
    padded, jagged = build_padded(rows), batches_module.build_jagged(rows)

    def resizable(batch: Any) -> dict[str, bool]:
        tensors = {k: batch.get(k) for k in batch.keys() if isinstance(batch.get(k), torch.Tensor)}
        return {
            k: (v.values() if v.is_nested else v).untyped_storage().resizable()
            for k, v in tensors.items()
        }

    before = resizable(padded), resizable(jagged)
    assert all(before[0].values())
    check_same(batches_module.concat_padded([padded, jagged]), build_padded(rows + rows))
    check_same(batches_module.densify(jagged), padded)
    assert (resizable(padded), resizable(jagged)) == before
