"""The rows of a step's batch are built with the cyclic collector paused, and left on."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from sessions import tokens
from sessions.batches import rows
from sessions.errors import ProjectionError


def _queue_row(position: int, **over: Any) -> dict[str, Any]:
    row = {
        "kind": "row",
        "key": f"u_0_{position}",
        "source_position": position,
        "reward": 1.0,
        "is_placeholder": False,
        "prompt_len": 2,
        "response_len": 3,
        "is_partial": False,
    }
    return {**row, **over}


def _source(prompt: list[int], response: list[int]) -> tuple[str, int, dict[str, Any], bytes]:
    arrays = tokens.TokenArrays(
        np.array(prompt, "<i4"), np.array(response, "<i4"), np.ones(len(response), np.uint8), None
    )
    data = {"prompt_len": len(prompt), "response_len": len(response), "has_logprobs": False}
    return "TrajectoryRecorded", 2, data, tokens.encode(arrays)


def test_materialise_pauses_the_collector_and_turns_it_back_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bool] = []
    real = tokens.decode

    def watched(*args: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(tokens, "decode", watched)
    built = rows.materialise(
        [_queue_row(1), _queue_row(2, kind="tag"), _queue_row(3)],
        {1: _source([5, 6], [7, 8, 9]), 3: _source([1], [2])},
    )
    assert seen == [False, False] and gc.isenabled()
    assert [r.prompt_ids.tolist() for r in built] == [[5, 6], [1]]
    assert built[0].meta["key"] == "u_0_1" and built[0].meta["is_partial"] is False


def test_materialise_turns_the_collector_back_on_when_a_row_is_refused() -> None:
    with pytest.raises(ProjectionError, match="missing"):
        rows.materialise([_queue_row(1)], {})
    assert gc.isenabled()


def test_a_rows_meta_holds_every_column_the_batch_takes_from_it() -> None:
    """One list, `columns.ROW_META`: a queue row's BatchRow carries every non-tensor META column
    and `num_turns`, so the batch's `num_turns` is the queue row's, never `UNKNOWN_TURNS`."""
    from sessions.batches import build_padded, non_tensor
    from sessions.batches.columns import META_COLUMNS, ROW_META

    queued = _queue_row(1, num_turns=4, run="r", uid="u", failure_reason=None, is_partial=True)
    built = rows.materialise([queued], {1: _source([5, 6], [7, 8, 9])})
    assert set(built[0].meta) == set(ROW_META) == {*META_COLUMNS, "num_turns"}
    batch = build_padded(built)
    assert batch.get("num_turns").tolist() == [4]
    assert non_tensor(batch, "run") == ["r"] and non_tensor(batch, "is_partial") == [True]
