"""Fixed padded widths (issue #14 item 7, second half): verl pads every step to its
max_prompt_length / max_response_length, so two steps' batches concatenate. build_padded,
densify and concat_padded take prompt_width / response_width; pad_to_widths re-pads a batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sessions.batches import (
    BatchRow,
    BatchTooLongError,
    build_jagged,
    build_padded,
    concat_padded,
    densify,
    pad_to_widths,
)
from tests.batches.strategies import assert_same_batch, rows

pytestmark = pytest.mark.verl_env

EXAMPLES = settings(max_examples=40, deadline=None)


def longest(batch_rows: list[BatchRow]) -> tuple[int, int]:
    return max((len(r.prompt_ids) for r in batch_rows), default=0), max(
        (len(r.response_ids) for r in batch_rows), default=0
    )


def unpadded(batch: Any, P: int, R: int) -> dict[str, torch.Tensor]:
    """The batch's columns cut back to P x R (the tokens beyond were padding)."""
    Pw = batch.get("prompts").shape[1]
    out: dict[str, torch.Tensor] = {}
    for name in batch.keys():
        value = batch.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if name == "prompts":
            value = value[:, Pw - P :]
        elif name in ("input_ids", "attention_mask", "position_ids"):
            value = value[:, Pw - P : Pw + R]
        elif value.dim() == 2:
            value = value[:, :R]
        out[name] = value
    return out


def key_of(row: BatchRow) -> Any:
    return row.meta["key"]


@EXAMPLES
@given(
    batch_rows=rows(),
    extra=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    pad=st.sampled_from([0, 7]),
)
def test_fixed_widths_are_exact_and_change_nothing_else(
    batch_rows: list[BatchRow], extra: tuple[int, int], pad: int
) -> None:
    P, R = longest(batch_rows)
    Pw, Rw = P + extra[0], R + extra[1]
    wide = build_padded(batch_rows, pad_token_id=pad, prompt_width=Pw, response_width=Rw)
    natural = build_padded(batch_rows, pad_token_id=pad)
    assert wide.get("prompts").shape == (len(batch_rows), Pw) and wide.get("responses").shape == (
        len(batch_rows),
        Rw,
    )
    assert wide.get("input_ids").shape[1] == wide.get("position_ids").shape[1] == Pw + Rw
    for name, value in unpadded(wide, P, R).items():
        assert value.dtype == natural.get(name).dtype and torch.equal(value, natural.get(name)), (
            name
        )
    # the extra padding is padding: pad ids, mask 0, no reward, positions as verl computes them
    assert (wide.get("prompts")[:, : Pw - P] == pad).all() and (
        wide.get("responses")[:, R:] == pad
    ).all()
    assert (
        not wide.get("attention_mask")[:, : Pw - P].any()
        and not wide.get("attention_mask")[:, Pw + R :].any()
    )
    assert not wide.get("response_mask")[:, R:].any() and not wide.get("rm_scores")[:, R:].any()
    expected_positions = (wide.get("attention_mask").cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(wide.get("position_ids"), expected_positions)
    # every other way to those widths gives the same batch
    jagged = build_jagged(batch_rows)
    assert_same_batch(densify(jagged, pad, prompt_width=Pw, response_width=Rw), wide)
    assert_same_batch(pad_to_widths(natural, Pw, Rw, pad_token_id=pad), wide)
    assert_same_batch(pad_to_widths(wide, P, R, pad_token_id=pad), natural)  # and back
    assert_same_batch(pad_to_widths(jagged, Pw, Rw, pad_token_id=pad), wide)
    assert_same_batch(pad_to_widths(natural, None, None, pad_token_id=pad), natural)


@EXAMPLES
@given(a=rows(), b=rows(), extra=st.integers(0, 3))
def test_two_steps_at_fixed_widths_concatenate_with_torch_cat(
    a: list[BatchRow], b: list[BatchRow], extra: int
) -> None:
    P, R = longest(a + b)
    Pw, Rw = P + extra, R + extra
    both = build_padded(a + b, prompt_width=Pw, response_width=Rw)
    step1, step2 = (build_padded(x, prompt_width=Pw, response_width=Rw) for x in (a, b))
    if set(step1.keys()) == set(step2.keys()):  # both or neither with logprobs
        assert_same_batch(torch.cat([step1, step2]), both)
    assert_same_batch(
        concat_padded([build_padded(a), build_jagged(b)], prompt_width=Pw, response_width=Rw), both
    )


@EXAMPLES
@given(batch_rows=rows(min_size=1), cut=st.tuples(st.integers(0, 12), st.integers(0, 12)))
def test_a_row_wider_than_a_width_is_refused_or_truncated(
    batch_rows: list[BatchRow], cut: tuple[int, int]
) -> None:
    Pw, Rw = cut
    natural = build_padded(batch_rows)
    over = [
        (key_of(r), side)
        for r in batch_rows
        for side, n, w in (("prompt", len(r.prompt_ids), Pw), ("response", len(r.response_ids), Rw))
        if n > w
    ]
    if over:
        first_prompt = next((k for k, side in over if side == "prompt"), None)
        key, side = (
            (first_prompt, "prompt")
            if first_prompt is not None
            else next((k, s) for k, s in over if s == "response")
        )
        for make in (
            lambda: build_padded(batch_rows, prompt_width=Pw, response_width=Rw),
            lambda: pad_to_widths(natural, Pw, Rw),
            lambda: densify(build_jagged(batch_rows), prompt_width=Pw, response_width=Rw),
        ):
            with pytest.raises(BatchTooLongError) as err:
                make()
            assert (err.value.key, err.value.side, err.value.option) == (key, side, f"{side}_width")
            assert f"{side}_width={cut[0] if side == 'prompt' else cut[1]}" in str(err.value)
    built = build_padded(batch_rows, prompt_width=Pw, response_width=Rw, truncate=True)
    assert built.get("prompts").shape[1] == Pw and built.get("responses").shape[1] == Rw
    repadded = pad_to_widths(natural, Pw, Rw, truncate=True)
    assert_same_batch(repadded, built)  # re-padding a built batch cuts as building does
    keeps_a_token = torch.tensor([Rw > 0 or len(r.response_ids) == 0 for r in batch_rows])
    scores = natural.get("rm_scores").sum(-1)
    assert torch.equal(
        repadded.get("rm_scores").sum(-1)[keeps_a_token], scores[keeps_a_token]
    )  # scores stay


def test_both_limits_the_smaller_binds_and_is_named() -> None:
    row = BatchRow(
        np.arange(1, 7, dtype=np.int32),
        np.ones(2, np.int32),
        np.ones(2, np.uint8),
        None,
        1.0,
        False,
        {"key": "r_0_0"},
    )
    with pytest.raises(
        BatchTooLongError,
        match=r"'r_0_0': prompt length 6 exceeds max_prompt_length=4; .*raise max_prompt_length",
    ):
        build_padded([row], max_prompt_length=4, prompt_width=8)
    with pytest.raises(BatchTooLongError, match=r"prompt length 6 exceeds prompt_width=5"):
        build_padded([row], max_prompt_length=9, prompt_width=5)
    batch = build_padded([row], max_prompt_length=4, prompt_width=8, truncate=True)
    assert batch.get("prompts").tolist() == [[0, 0, 0, 0, 3, 4, 5, 6]]  # cut to 4, padded to 8


@pytest.mark.parametrize("option", ["prompt_width", "response_width"])
@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_bad_widths_are_refused(option: str, bad: Any) -> None:
    row = BatchRow(
        np.ones(1, np.int32), np.ones(1, np.int32), np.ones(1, np.uint8), None, 1.0, False, {}
    )
    with pytest.raises(ValueError, match=option):
        build_padded([row], **{option: bad})
    with pytest.raises(ValueError, match=option):
        pad_to_widths(
            build_padded([row]), **{"prompt_width": None, "response_width": None, option: bad}
        )


def test_empty_batch_at_fixed_widths_concatenates_with_a_full_one() -> None:
    row = BatchRow(
        np.ones(3, np.int32),
        np.ones(2, np.int32),
        np.ones(2, np.uint8),
        None,
        1.0,
        False,
        {"key": "a_0_0"},
    )
    empty, full = (
        build_padded([], prompt_width=4, response_width=4),
        build_padded([row], prompt_width=4, response_width=4),
    )
    assert empty.get("input_ids").shape == (0, 8)
    assert_same_batch(torch.cat([empty, full]), full)


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(a=rows(min_size=1), b=rows(min_size=1))
def test_verl_concatenates_two_steps_at_fixed_widths(
    verl_installed: None, a: list[BatchRow], b: list[BatchRow]
) -> None:
    from verl import DataProto

    P, R = longest(a + b)
    step1, step2 = (build_padded(x, prompt_width=P + 2, response_width=R + 2) for x in (a, b))
    # verl concatenates batches of the same columns only: both steps with logprobs, or neither
    assume(set(step1.keys()) == set(step2.keys()))
    joined = DataProto.concat([DataProto.from_tensordict(step1), DataProto.from_tensordict(step2)])
    assert len(joined) == len(a) + len(b)
    assert joined.batch["responses"].shape[1] == R + 2
    assert joined.non_tensor_batch["key"].tolist() == [r.meta["key"] for r in a + b]
