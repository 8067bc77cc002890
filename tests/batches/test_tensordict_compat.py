"""Row operations on batches under every supported tensordict (0.10.0, verl 0.9.1's pin, to the
newest): empty batches, select_rows / concat_batches / split_batch on both layouts, jagged
widths (issue #14 items 3 and 4), and the one workaround tensordict_compat applies.

Where this tensordict does the operation itself (``NATIVE_*`` flags), the results must equal its
own; where it cannot (0.10.0 on jagged batches or on selections of no rows), the functions must
still give what building the selected rows gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from sessions.batches import (
    BatchRow,
    build_jagged,
    build_padded,
    concat_batches,
    densify,
    non_tensor,
    non_tensor_stacks,
    select_rows,
    split_batch,
    tensordict_compat,
)
from sessions.batches.tensordict_compat import NATIVE_EMPTY_SELECTION, NATIVE_JAGGED_ROW_OPS
from tests.batches.strategies import assert_declared_columns, assert_same_batch, rows

pytestmark = pytest.mark.verl_env

EXAMPLES = settings(max_examples=40, deadline=None)
JAGGED = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rm_scores",
)


@st.composite
def row_index(draw: st.DrawFn, n: int) -> tuple[Any, list[int]]:
    """An index of every kind select_rows takes, and the row ids it selects in order."""
    kind = draw(
        st.sampled_from(
            ["int", "slice", "mask", "ids", "list", "numpy"] if n else ["slice", "mask", "ids"]
        )
    )
    if kind == "int":
        i = draw(st.integers(-n, n - 1))
        return i, [i % n]
    if kind == "slice":
        start, stop = (
            draw(st.one_of(st.none(), st.integers(-n - 1, n + 1))),
            draw(st.one_of(st.none(), st.integers(-n - 1, n + 1))),
        )
        step = draw(st.one_of(st.none(), st.sampled_from([1, 2, -1, -2])))
        s = slice(start, stop, step)
        return s, list(range(n))[s]
    if kind == "mask":
        mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        return torch.tensor(mask, dtype=torch.bool), [i for i, m in enumerate(mask) if m]
    ids = draw(st.lists(st.integers(-n, n - 1), max_size=2 * n)) if n else []
    picked = [i % n for i in ids]
    if kind == "list":
        return ids, picked
    if kind == "numpy":
        return np.asarray(ids, dtype=np.int64), picked
    return torch.tensor(ids, dtype=torch.int64), picked


def widths(batch: Any) -> tuple[int, int]:
    return batch.get("prompts").shape[1], batch.get("responses").shape[1]


def assert_jagged_widths(batch: Any) -> None:
    """verl-like use: to_padded_tensor is as wide as the longest row, not the total token count."""
    for name in JAGGED:
        value = batch.get(name)
        longest = max((len(t) for t in value.unbind()), default=0)
        assert value.to_padded_tensor(0).shape == (batch.batch_size[0], longest), name


def without_zero_logprobs(batch: Any, chosen: list[BatchRow]) -> Any:
    """A selection keeps its batch's logprobs column, zeros on rows without logprobs; building
    only the chosen rows has no such column when none of them has logprobs."""
    if "rollout_log_probs" in batch.keys() and all(r.logprobs is None for r in chosen):
        assert not batch.get("rollout_log_probs").any()
        return batch.exclude("rollout_log_probs")
    return batch


# ------------------------------------------------------------------------------ select_rows
@EXAMPLES
@given(batch_rows=rows(), data=st.data())
def test_select_rows_equals_building_the_selected_rows(
    batch_rows: list[BatchRow], data: Any
) -> None:
    index, ids = data.draw(row_index(len(batch_rows)))
    chosen = [batch_rows[i] for i in ids]
    padded, jagged = build_padded(batch_rows), build_jagged(batch_rows)
    P, R = widths(padded)

    got_padded = select_rows(padded, index)
    assert_same_batch(
        without_zero_logprobs(got_padded, chosen),
        build_padded(chosen, prompt_width=P, response_width=R),
    )
    got_jagged = select_rows(jagged, index)
    assert_same_batch(without_zero_logprobs(densify(got_jagged), chosen), build_padded(chosen))
    assert_jagged_widths(got_jagged)
    for batch in (got_padded, got_jagged):
        assert_declared_columns(batch, chosen, batch_rows)

    if isinstance(index, slice) and (index.step or 1) < 0:
        return  # torch tensors themselves take no negative step; select_rows does
    native_index = [index] if isinstance(index, int) else index  # an int: a batch of one row
    if NATIVE_EMPTY_SELECTION or ids:
        assert_same_batch(got_padded, padded[native_index])
    if NATIVE_JAGGED_ROW_OPS:
        assert_same_batch(got_jagged, jagged[native_index])


def test_select_rows_refuses_what_is_not_a_row_index() -> None:
    batch = build_padded(
        [
            BatchRow(
                np.ones(1, np.int32),
                np.ones(1, np.int32),
                np.ones(1, np.uint8),
                None,
                1.0,
                False,
                {},
            )
        ]
        * 3
    )
    with pytest.raises(IndexError, match="row 3 out of range for a batch of 3"):
        select_rows(batch, 3)
    with pytest.raises(IndexError, match="row -4 out of range"):
        select_rows(batch, [0, -4])
    with pytest.raises(IndexError, match="mask must have 3 entries"):
        select_rows(batch, torch.tensor([True, False]))
    with pytest.raises(IndexError, match="integers or booleans"):
        select_rows(batch, torch.tensor([0.0]))
    with pytest.raises(IndexError, match="1-D"):
        select_rows(batch, torch.zeros(1, 1, dtype=torch.int64))


# ------------------------------------------------------------------------------ concat_batches
@EXAMPLES
@given(a=rows(), b=rows())
def test_concat_batches_equals_building_all_rows(a: list[BatchRow], b: list[BatchRow]) -> None:
    expected = build_padded(a + b)
    ja, jb = build_jagged(a), build_jagged(b)
    if set(ja.keys()) != set(jb.keys()):  # logprobs in one only: concat_padded fills them
        with pytest.raises(ValueError, match="rollout_log_probs"):
            concat_batches([ja, jb])
        return
    joined = concat_batches([ja, jb])
    assert_same_batch(densify(joined), expected)
    assert_jagged_widths(joined)
    P, R = widths(expected)
    pa, pb = (build_padded(x, prompt_width=P, response_width=R) for x in (a, b))
    assert_same_batch(concat_batches([pa, pb]), expected)
    assert_same_batch(torch.cat([pa, pb]), expected)  # padded batches of one width: plain torch.cat
    if NATIVE_JAGGED_ROW_OPS:
        assert_same_batch(torch.cat([ja, jb]), joined)
        assert_jagged_widths(torch.cat([ja, jb]))  # tensordict's own cat keeps the bounds too


def test_concat_batches_names_what_differs() -> None:
    one = [
        BatchRow(
            np.ones(2, np.int32), np.ones(1, np.int32), np.ones(1, np.uint8), None, 1.0, False, {}
        )
    ]
    with pytest.raises(ValueError, match="'prompts': widths differ.*concat_padded"):
        concat_batches([build_padded(one), build_padded(one, prompt_width=5)])
    with pytest.raises(ValueError, match="jagged in some batches"):
        concat_batches([build_padded(one), build_jagged(one)])
    with pytest.raises(ValueError, match="at least one batch"):
        concat_batches([])


# ------------------------------------------------------------------------------ split_batch
@EXAMPLES
@given(batch_rows=rows(), data=st.data())
def test_split_batch_gives_consecutive_chunks_that_concatenate_back(
    batch_rows: list[BatchRow], data: Any
) -> None:
    n = len(batch_rows)
    if data.draw(st.booleans()):
        size: Any = data.draw(st.integers(1, n + 2))
        sizes = [min(size, n - s) for s in range(0, n, size)] or [0]
    else:
        cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        size = sizes
    for build in (build_padded, build_jagged):
        batch = build(batch_rows)
        parts = split_batch(batch, size)
        assert [p.batch_size[0] for p in parts] == sizes
        assert_same_batch(concat_batches(list(parts)), batch)
        start = 0
        for part, k in zip(parts, sizes):
            assert non_tensor(part, "key") == non_tensor(batch, "key")[start : start + k]
            start += k
        # tensordict's own split: not for chunks of 0 rows, whose non-tensor columns 0.15.3
        # turns into LazyStackedTensorDicts (and 0.10.0 cannot make)
        if 0 not in sizes and (build is build_padded or NATIVE_JAGGED_ROW_OPS):
            for mine, theirs in zip(parts, batch.split(size)):
                assert_same_batch(mine, theirs)


def test_split_batch_refuses_sizes_that_do_not_cover_the_batch() -> None:
    batch = build_jagged(
        [
            BatchRow(
                np.ones(1, np.int32),
                np.ones(1, np.int32),
                np.ones(1, np.uint8),
                None,
                1.0,
                False,
                {},
            )
        ]
        * 3
    )
    with pytest.raises(ValueError, match="add up to the batch's 3 rows"):
        split_batch(batch, [1, 1])
    with pytest.raises(ValueError, match=">= 1"):
        split_batch(batch, 0)


# ------------------------------------------------------------------------------ jagged widths
@EXAMPLES
@given(batch_rows=rows(min_size=1))
def test_jagged_columns_pad_to_the_longest_row(batch_rows: list[BatchRow]) -> None:
    batch = build_jagged(batch_rows)
    assert_jagged_widths(batch)
    longest = max(len(r.response_ids) for r in batch_rows)
    assert batch["responses"].to_padded_tensor(0).shape[1] == longest


def test_one_long_row_among_many_pads_to_its_own_length_not_the_total() -> None:
    """The issue's case: 1,024 tokens in a batch of ~20k -> 1,024 columns, not ~20k."""
    rng = np.random.default_rng(0)
    lengths = [1024] + rng.integers(100, 600, 40).tolist()
    batch = build_jagged(
        [
            BatchRow(
                np.ones(5, np.int32),
                np.ones(n, np.int32),
                np.ones(n, np.uint8),
                None,
                1.0,
                False,
                {},
            )
            for n in lengths
        ]
    )
    assert sum(lengths) > 10_000
    assert batch["responses"].to_padded_tensor(0).shape == (len(lengths), 1024)
    assert batch["input_ids"].to_padded_tensor(0).shape == (len(lengths), 1029)


# ------------------------------------------------------------------------------ empty batches
def test_empty_batches_have_every_column_and_take_every_row_operation() -> None:
    one = [
        BatchRow(
            np.ones(2, np.int32),
            np.ones(3, np.int32),
            np.ones(3, np.uint8),
            None,
            1.0,
            False,
            {"key": "a_0_0"},
        )
    ]
    for build in (build_padded, build_jagged):
        empty = build([])
        assert_declared_columns(empty, [], one)  # logprobs-free rows: the same columns as `full`
        assert_same_batch(select_rows(empty, []), empty)
        assert_same_batch(select_rows(empty, torch.zeros(0, dtype=torch.bool)), empty)
        assert len(split_batch(empty, 2)) == 1
    assert_same_batch(
        concat_batches([build_jagged([]), build_jagged(one), build_jagged([])]), build_jagged(one)
    )
    assert_same_batch(select_rows(build_jagged(one), []), build_jagged([]))
    assert_same_batch(
        select_rows(build_padded(one), []), build_padded([], prompt_width=2, response_width=3)
    )
    assert_same_batch(torch.cat([build_padded([]), build_padded([])]), build_padded([]))


# ------------------------------------------------------------------------------ the workaround
def test_flags_are_what_this_tensordict_does() -> None:
    assert tensordict_compat.EMPTY_STACK_SET_FAILS == tensordict_compat._empty_stack_set_fails()
    assert NATIVE_JAGGED_ROW_OPS == tensordict_compat._native_jagged_row_ops()
    assert NATIVE_EMPTY_SELECTION == tensordict_compat._native_empty_selection()
    if tensordict_compat.EMPTY_STACK_SET_FAILS:  # the upstream behaviour the workaround exists for
        with pytest.raises(IndexError):
            TensorDict({}, batch_size=[0]).set("x", NonTensorStack.from_list([]))


def test_empty_batches_build_only_thanks_to_the_workaround_where_it_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without set_stack's workaround an empty batch fails exactly where the flag says it would."""
    assert build_padded([]).batch_size == torch.Size([0])
    monkeypatch.setattr(
        non_tensor_stacks, "set_stack", lambda batch, name, stack: batch.set(name, stack)
    )
    if tensordict_compat.EMPTY_STACK_SET_FAILS:
        with pytest.raises(IndexError):
            build_padded([])
    else:
        assert build_padded([]).batch_size == torch.Size([0])


def test_set_stack_refuses_a_stack_of_another_length() -> None:
    batch = TensorDict({}, batch_size=[2])
    with pytest.raises((ValueError, RuntimeError)):
        tensordict_compat.set_stack(batch, "x", NonTensorStack.from_list([]))


def test_building_a_jagged_batch_prints_nothing_on_stderr() -> None:
    """torch logs a tracing notice on the first nested_tensor_from_jagged of a process; the CLI's
    one-line errors and exports must not carry it (tensordict_compat spends it silently)."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from sessions.batches import BatchRow, build_jagged\n"
        "row = BatchRow(np.array([1, 2]), np.array([3]), np.array([1]), None, 1.0, False)\n"
        "assert build_jagged([row, row])['responses'].to_padded_tensor(0).shape == (2, 1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
