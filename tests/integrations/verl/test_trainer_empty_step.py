"""An empty step concatenates with its run's other steps.

A step whose every session was cancelled or dropped has no rows. By §6 ``rollout_log_probs``
exists iff a row carries logprobs, so such a step's batch lacked the column a run that records
logprobs has everywhere else, and ``torch.cat`` / verl's ``DataProto.concat`` of it with a
normal step raised ``KeyError``. ``build_padded(..., logprobs=True)`` gives every batch the
column (``[0, R]`` for an empty one); the default keeps §6's rule, ``False`` leaves it out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions.batches import (
    BatchRow,
    build_padded,
    concat_batches,
    concat_padded,
    non_tensor,
    pad_to_widths,
)
from sessions.errors import InvalidArgument
from tests.conftest import require_verl

pytestmark = pytest.mark.verl_env
P, R = 6, 5


@st.composite
def step_rows(draw: st.DrawFn, min_size: int = 0) -> list[BatchRow]:
    rows = []
    for i in range(draw(st.integers(min_size, 5))):
        response = draw(st.integers(1, R))
        with_logprobs = draw(st.booleans())
        rows.append(
            BatchRow(
                prompt_ids=np.arange(1, draw(st.integers(1, P)) + 1),
                response_ids=np.arange(10, 10 + response),
                response_mask=np.ones(response, dtype=np.int64),
                logprobs=-np.linspace(0.1, 1.0, response) if with_logprobs else None,
                reward=float(draw(st.sampled_from([0.0, 1.0]))),
                is_placeholder=False,
                meta={"uid": f"u{i}", "session_index": 0, "partition": "train", "key": f"u{i}_0_0"},
            )
        )
    return rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=step_rows(), logprobs=st.sampled_from([None, True, False]))
def test_the_column_follows_the_option(rows: list[BatchRow], logprobs: bool | None) -> None:
    batch = build_padded(rows, prompt_width=P, response_width=R, logprobs=logprobs)
    carried = any(r.logprobs is not None for r in rows)
    expected = carried if logprobs is None else logprobs
    assert ("rollout_log_probs" in batch.keys()) == expected
    if expected:
        lp = batch["rollout_log_probs"]
        assert lp.shape == (len(rows), R) and lp.dtype == torch.float32
        for i, row in enumerate(rows):
            n = len(row.response_ids)
            want = np.zeros(n) if row.logprobs is None else row.logprobs
            assert np.allclose(lp[i, :n].numpy(), want) and not lp[i, n:].any()
    # re-laying out the batch keeps what it has, the empty one included
    assert set(pad_to_widths(batch, P + 1, R + 1).keys()) == set(batch.keys())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=step_rows(min_size=1))
def test_an_empty_step_concatenates_with_a_normal_one(rows: list[BatchRow]) -> None:
    normal = build_padded(rows, prompt_width=P, response_width=R, logprobs=True)
    empty = build_padded([], prompt_width=P, response_width=R, logprobs=True)
    assert set(empty.keys()) == set(normal.keys())  # every column, logprobs included
    for joined in (
        torch.cat([empty, normal]),
        torch.cat([normal, empty]),
        concat_batches([empty, normal]),
        concat_padded([empty, normal], prompt_width=P, response_width=R),
    ):
        assert joined.batch_size[0] == len(rows)
        assert torch.equal(joined["rollout_log_probs"], normal["rollout_log_probs"])
        assert non_tensor(joined, "uid") == non_tensor(normal, "uid")


def test_by_default_an_empty_step_has_no_logprobs_and_the_old_failure_is_a_key_error() -> None:
    rows = [
        BatchRow(
            prompt_ids=np.array([1]),
            response_ids=np.array([2, 3]),
            response_mask=np.array([1, 1]),
            logprobs=np.array([-0.5, -0.25]),
            reward=1.0,
            is_placeholder=False,
            meta={"uid": "u", "session_index": 0, "partition": "train", "key": "u_0_0"},
        )
    ]
    normal = build_padded(rows, prompt_width=P, response_width=R)
    empty = build_padded([], prompt_width=P, response_width=R)
    assert "rollout_log_probs" not in empty.keys()
    with pytest.raises(KeyError):
        torch.cat([empty, normal])
    with pytest.raises(InvalidArgument, match="logprobs"):
        build_padded(rows, logprobs="yes")  # type: ignore[arg-type]


def test_verls_data_proto_concat_takes_the_empty_step() -> None:
    require_verl()
    from verl import DataProto

    from sessions.integrations.verl import to_data_proto

    rows = [
        BatchRow(
            prompt_ids=np.array([1, 2]),
            response_ids=np.array([3]),
            response_mask=np.array([1]),
            logprobs=np.array([-0.5]),
            reward=1.0,
            is_placeholder=False,
            meta={"uid": "u", "session_index": 0, "partition": "train", "key": "u_0_0"},
        )
    ]
    normal = to_data_proto(build_padded(rows, prompt_width=P, response_width=R, logprobs=True))
    empty = to_data_proto(build_padded([], prompt_width=P, response_width=R, logprobs=True))
    joined = DataProto.concat([empty, normal])
    assert len(joined) == 1 and "rollout_log_probs" in joined.batch.keys()
