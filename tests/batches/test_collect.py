"""The once-per-batch checks of ``collect`` accept, refuse and gather exactly what the per-row
loop does: the fast path is only a shortcut, the loop stays the authority on every message."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessions.batches import BatchRow, build_padded, collect
from sessions.batches.columns import META_COLUMNS
from sessions.errors import LedgerError
from tests.batches.strategies import assert_same_batch, rows


def _full_meta(meta: dict[str, Any], i: int) -> dict[str, Any]:
    """A meta holding every column, as ``Ledger.batch``'s rows carry (the transposed path)."""
    full: dict[str, Any] = {name: None for name in META_COLUMNS}
    full.update(is_partial=bool(i % 2), num_turns=i % 3, global_step=np.int64(i))
    full.update(meta)
    return full


_BREAKS = (
    "none",
    "prompt_list",
    "prompt_2d",
    "prompt_float",
    "empty_float_prompt",
    "short_mask",
    "short_logprobs",
    "int_logprobs",
    "not_a_row",
    "subclass",
)


class _Row(BatchRow):
    __slots__ = ()


def _broken(row: BatchRow, how: str) -> Any:
    """One row changed the way ``how`` says: some still valid (lists, an empty float prompt, a
    subclass), most refused."""
    replace = dataclasses.replace
    if how == "prompt_list":
        return replace(row, prompt_ids=row.prompt_ids.tolist())
    if how == "prompt_2d":
        return replace(row, prompt_ids=row.prompt_ids[None, :])
    if how == "prompt_float":
        return replace(row, prompt_ids=np.ones(3, np.float32))
    if how == "empty_float_prompt":
        return replace(row, prompt_ids=np.zeros(0, np.float64))
    if how == "short_mask":
        return replace(row, response_mask=np.zeros(len(row.response_ids) + 1, np.uint8))
    if how == "short_logprobs":
        return replace(row, logprobs=np.zeros(len(row.response_ids) + 1, np.float32))
    if how == "int_logprobs":
        return replace(row, logprobs=np.ones(len(row.response_ids) + 1, np.int64))
    if how == "not_a_row":
        return dataclasses.asdict(row)
    if how == "subclass":
        return _Row(*dataclasses.astuple(row)[:6], row.meta)
    return row


def _outcome(batch_rows: list[Any]) -> tuple[str, Any]:
    try:
        return "built", build_padded(batch_rows)
    except (LedgerError, TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)


@given(
    rows(min_size=1),
    st.booleans(),
    st.sampled_from(_BREAKS),
    st.data(),
)
def test_fast_checks_agree_with_the_row_by_row_loop(
    batch_rows: list[BatchRow], full_meta: bool, how: str, data: st.DataObject
) -> None:
    if full_meta:
        batch_rows = [
            dataclasses.replace(r, meta=_full_meta(dict(r.meta), i))
            for i, r in enumerate(batch_rows)
        ]
    i = data.draw(st.integers(0, len(batch_rows) - 1))
    batch_rows[i] = _broken(batch_rows[i], how)
    fast = _outcome(batch_rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(collect, "_arrays_at_once", lambda _rows: None)
        mp.setattr(collect, "_DICT_ONLY", frozenset())
        slow = _outcome(batch_rows)
    assert fast[0] == slow[0], (fast, slow)
    if fast[0] == "built":
        assert_same_batch(fast[1], slow[1])
    else:
        assert fast[1] == slow[1]


def test_a_full_meta_takes_the_transposed_path_and_keeps_numpy_scalars_plain() -> None:
    """Rows like ``Ledger.batch``'s: every column from the one itemgetter call a row, numpy
    scalars turned into Python ones (weights_only loading needs them plain)."""
    metas = [_full_meta({"key": f"k{i}"}, i) for i in range(3)]
    columns = collect._meta_columns(metas)
    assert columns["key"] == ["k0", "k1", "k2"]
    assert columns["num_turns"] == [0, 1, 2]
    gathered, keys = collect._collect(
        [
            BatchRow(
                np.ones(1, np.int32),
                np.ones(1, np.int32),
                np.ones(1, np.uint8),
                None,
                1.0,
                False,
                m,
            )
            for m in metas
        ]
    )
    assert keys == ["k0", "k1", "k2"]
    assert gathered.non_tensor["global_step"] == [0, 1, 2]
    assert all(type(v) is int for v in gathered.non_tensor["global_step"])


def test_a_mapping_meta_is_read_with_get_and_never_grown() -> None:
    """A defaultdict meta must not gain keys: the transposed path would index it."""
    from collections import defaultdict

    meta: defaultdict[str, Any] = defaultdict(lambda: "x", key="k")
    row = BatchRow(
        np.ones(1, np.int32), np.ones(1, np.int32), np.ones(1, np.uint8), None, 1.0, False, meta
    )
    gathered, _ = collect._collect([row])
    assert gathered.non_tensor["uid"] == [None]
    assert set(meta) == {"key"}
