"""Hypothesis strategies and comparisons shared by the batch tests (layouts, row operations, widths).

Rows cover what the writers special-case: 0-length prompts and responses, docs/design.md §5
placeholders, logprobs on none / some / all rows, ``num_turns`` present or absent in ``meta``,
several id and mask dtypes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from tensordict import NonTensorStack

from sessions.batches import (
    COLUMN_DTYPES,
    NON_TENSOR_COLUMNS,
    ROW_COLUMNS,
    TOKEN_COLUMNS,
    BatchRow,
    non_tensor,
)
from sessions.batches.jagged import is_jagged, jagged_parts

LENGTHS = st.one_of(st.just(0), st.integers(0, 12))


@st.composite
def rows(draw: st.DrawFn, min_size: int = 0, max_size: int = 7) -> list[BatchRow]:
    n = draw(st.integers(min_size, max_size))
    logprobs_on = draw(st.sampled_from(["none", "some", "all"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for i in range(n):
        meta: dict[str, Any] = {
            "key": f"u{i % 3}_{i}_0",
            "uid": f"u{i % 3}",
            "session_index": i,
            "data_source": "ds",
        }
        with_lp = logprobs_on == "all" or (logprobs_on == "some" and draw(st.booleans()))
        if draw(st.integers(0, 4)) == 0:
            token = int(rng.integers(1, 500))
            meta.update(failure_reason="timeout", materialization_reason="session_failed")
            if draw(st.booleans()):
                meta["num_turns"] = 0
            ids = np.asarray([token], np.int32)
            out.append(
                BatchRow(
                    ids,
                    ids.copy(),
                    np.zeros(1, np.uint8),
                    np.zeros(1, np.float32) if with_lp else None,
                    0.0,
                    True,
                    meta,
                )
            )
            continue
        if draw(st.booleans()):
            meta["num_turns"] = draw(st.integers(0, 6))
        p_len, r_len = draw(LENGTHS), draw(LENGTHS)
        id_dtype = draw(st.sampled_from([np.int32, np.int64, np.uint16]))
        out.append(
            BatchRow(
                rng.integers(1, 500, p_len).astype(id_dtype),
                rng.integers(1, 500, r_len).astype(id_dtype),
                rng.integers(0, 2, r_len).astype(
                    draw(st.sampled_from([np.uint8, np.bool_, np.int64]))
                ),
                (-rng.exponential(size=r_len)).astype(np.float32) if with_lp else None,
                draw(st.sampled_from([0.0, 1.0, -2.5, 0.75])),
                False,
                meta,
            )
        )
    return out


def expected_tensor_columns(batch_rows: list[BatchRow]) -> set[str]:
    """The tensor columns every layout of these rows has (``columns.py``)."""
    names = set(TOKEN_COLUMNS + ROW_COLUMNS)
    if not any(r.logprobs is not None for r in batch_rows):
        names.discard("rollout_log_probs")
    return names


def tensor_columns(batch: Any) -> dict[str, torch.Tensor]:
    return {k: batch.get(k) for k in batch.keys() if isinstance(batch.get(k), torch.Tensor)}


def dense(value: torch.Tensor) -> tuple[Any, ...]:
    """A comparable form of a dense or jagged column: its layout, dtype and every row's values."""
    if is_jagged(value):
        values, offsets = jagged_parts(value)
        return ("jagged", value.dtype, values.tolist(), offsets.tolist())
    return ("dense", value.dtype, tuple(value.shape), value.tolist())


def same_stack(a: NonTensorStack, b: NonTensorStack) -> bool:
    """Same stack state with the members made: a ``ColumnStack`` (build_padded's, members made
    late) and tensordict's own ``NonTensorStack`` differ in their class only."""
    from sessions.batches.non_tensor_stacks import _same_state

    if not (isinstance(a, NonTensorStack) and isinstance(b, NonTensorStack)):
        return False
    a.tensordicts, b.tensordicts  # noqa: B018 -- make a column stack's members
    state_a, state_b = vars(a), vars(b)
    return state_a.keys() == state_b.keys() and all(
        _same_state(state_a[k], state_b[k]) for k in state_a
    )


def assert_same_batch(a: Any, b: Any) -> None:
    """Same tensor columns (layout, dtype, values) and the same non-tensor columns, row by row."""
    ta, tb = tensor_columns(a), tensor_columns(b)
    assert set(ta) == set(tb), (sorted(ta), sorted(tb))
    assert a.batch_size == b.batch_size
    for key in ta:
        assert dense(ta[key]) == dense(tb[key]), key
    for name in NON_TENSOR_COLUMNS:
        assert non_tensor(a, name) == non_tensor(b, name), name


def assert_declared_columns(
    batch: Any, batch_rows: list[BatchRow], built_from: list[BatchRow] | None = None
) -> None:
    """Every column ``columns.py`` declares, with its dtype, aligned to the rows (``built_from``:
    the rows of the batch these were selected from, which decide whether logprobs exist)."""
    tensors = tensor_columns(batch)
    assert set(tensors) == expected_tensor_columns(batch_rows if built_from is None else built_from)
    for name, value in tensors.items():
        assert value.dtype == COLUMN_DTYPES[name], name
        assert value.shape[0] == len(batch_rows), name
    for name in ROW_COLUMNS:
        assert tensors[name].shape == (len(batch_rows),), name
    for name in NON_TENSOR_COLUMNS:
        assert isinstance(batch.get(name), NonTensorStack), (
            name
        )  # what DataProto.from_tensordict reads per row
        assert len(non_tensor(batch, name)) == len(batch_rows), name
    assert non_tensor(batch, "key") == [r.meta.get("key") for r in batch_rows]
    assert non_tensor(batch, "__num_turns__") == tensors["num_turns"].tolist()
