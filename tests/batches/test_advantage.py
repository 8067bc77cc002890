"""Tests for sessions.batches.advantage: verl's GRPO outcome advantage, optionally blind to placeholders."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions.batches import BatchRow, build_jagged, build_padded, non_tensor
from sessions.batches.advantage import grpo_outcome_advantage

FAST = settings(max_examples=50, deadline=None)
EPS = 1e-6


def row(
    uid: str, reward: float, r_len: int = 3, *, mask: list[int] | None = None, index: int = 0
) -> BatchRow:
    return BatchRow(
        prompt_ids=np.arange(1, 3, dtype=np.int32),
        response_ids=np.arange(1, r_len + 1, dtype=np.int32),
        response_mask=np.asarray([1] * r_len if mask is None else mask, dtype=np.uint8),
        logprobs=None,
        reward=reward,
        is_placeholder=False,
        meta={"uid": uid, "key": f"{uid}_{index}_0", "session_index": index},
    )


def failed(uid: str, index: int = 9) -> BatchRow:
    return BatchRow(
        prompt_ids=np.asarray([5], dtype=np.int32),
        response_ids=np.asarray([5], dtype=np.int32),
        response_mask=np.asarray([0], dtype=np.uint8),
        logprobs=None,
        reward=0.0,
        is_placeholder=True,
        meta={"uid": uid, "key": f"{uid}_{index}_0", "session_index": index},
    )


def scalar_advantages(batch: Any, **kwargs: Any) -> list[float]:
    """One advantage per row: the value on its first response token (rows here are all-masked-in)."""
    return grpo_outcome_advantage(batch, **kwargs)[:, 0].tolist()


def reference(
    batch: Any, exclude: bool, norm: bool, eps: float = EPS, min_valid: int = 1
) -> torch.Tensor:
    """verl's loop (core_algos.compute_grpo_outcome_advantage) in float64, plus exclusion and
    min_valid (a group with fewer included rows gives advantage 0; verl's own is min_valid=1)."""
    scores = batch["rm_scores"].sum(-1).double()
    uids = non_tensor(batch, "uid")
    skip = batch["is_placeholder"].tolist() if exclude else [False] * len(uids)
    id2score: dict[str, list[torch.Tensor]] = defaultdict(list)
    for i, uid in enumerate(uids):
        if not skip[i]:
            id2score[uid].append(scores[i])
    id2mean, id2std = {}, {}
    for uid, values in id2score.items():
        if len(values) == 1:
            id2mean[uid], id2std[uid] = (
                torch.tensor(0.0, dtype=torch.float64),
                torch.tensor(1.0, dtype=torch.float64),
            )
        else:
            stacked = torch.stack(values)
            id2mean[uid], id2std[uid] = torch.mean(stacked), torch.std(stacked)
    out = torch.zeros_like(scores)
    for i, uid in enumerate(uids):
        if skip[i] or len(id2score[uid]) < min_valid:
            continue
        centred = scores[i] - id2mean[uid]
        out[i] = centred / (id2std[uid] + eps) if norm else centred
    return (out.unsqueeze(-1) * batch["response_mask"]).float()


def verl_float32(batch: Any, eps: float = EPS) -> torch.Tensor:
    """A literal port of verl's float32 computation (no exclusion), for compatibility."""
    scores = batch["rm_scores"].sum(-1)
    index = non_tensor(batch, "uid")
    id2score: dict[str, list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, values in id2score.items():
        if len(values) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = (
                torch.mean(torch.stack(values)),
                torch.std(torch.stack(values)),
            )
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
    return scores.unsqueeze(-1) * batch["response_mask"]


@st.composite
def grouped_rows(draw: st.DrawFn) -> list[BatchRow]:
    """Random groups (1..5 sessions), random rewards, masks and placeholders, shuffled."""
    rows: list[BatchRow] = []
    for g in range(draw(st.integers(1, 5))):
        for i in range(draw(st.integers(1, 5))):
            if draw(st.integers(0, 3)) == 0:
                rows.append(failed(f"g{g}", index=i))
            else:
                r_len = draw(st.integers(1, 6))
                mask = draw(st.lists(st.integers(0, 1), min_size=r_len, max_size=r_len))
                reward = draw(
                    st.sampled_from([0.0, 1.0]) | st.floats(-5, 5, width=32, allow_subnormal=False)
                )
                rows.append(row(f"g{g}", reward, r_len, mask=mask, index=i))
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


# ------------------------------------------------------------------------------------------


@FAST
@given(rows=grouped_rows(), exclude=st.booleans(), norm=st.booleans(), min_valid=st.integers(0, 4))
def test_matches_per_group_loop_reference(
    rows: list[BatchRow], exclude: bool, norm: bool, min_valid: int
) -> None:
    batch = build_padded(rows)
    got = grpo_outcome_advantage(
        batch, exclude_placeholders=exclude, norm_by_std=norm, min_valid=min_valid
    )
    assert got.dtype == torch.float32 and got.shape == batch["responses"].shape
    torch.testing.assert_close(
        got, reference(batch, exclude, norm, min_valid=min_valid), rtol=1e-5, atol=1e-4
    )
    assert not got[batch["response_mask"] == 0].any()


@FAST
@given(rows=grouped_rows())
def test_without_exclusion_agrees_with_verl_float32(rows: list[BatchRow]) -> None:
    batch = build_padded(rows)
    got = grpo_outcome_advantage(
        batch, exclude_placeholders=False, min_valid=1
    )  # min_valid=1: verl's rule
    torch.testing.assert_close(got, verl_float32(batch), rtol=1e-5, atol=1e-4)


def test_exclusion_makes_a_failure_invisible_to_siblings() -> None:
    siblings = [row("p", 1.0, index=0), row("p", 0.0, index=1), row("p", 1.0, index=2)]
    with_failure = build_padded(siblings + [failed("p", index=3)])
    without = build_padded(siblings)

    excluded = scalar_advantages(with_failure, exclude_placeholders=True)
    assert excluded[:3] == scalar_advantages(without)
    assert excluded[3] == 0.0

    included = scalar_advantages(with_failure, exclude_placeholders=False)
    assert included[:3] != scalar_advantages(without)
    # verl semantics: the placeholder's 0 pulls the mean down, lifting every sibling
    assert all(a > b for a, b in zip(included[:3], excluded[:3]))


def test_placeholder_gets_zero_advantage_everywhere() -> None:
    batch = build_padded([row("p", 1.0), failed("p"), row("q", 2.0), row("q", 4.0), failed("q")])
    adv = grpo_outcome_advantage(batch)
    assert not adv[batch["is_placeholder"]].any()


def test_group_of_one_has_mean_zero_std_one() -> None:
    """verl's rule (min_valid=1); the default min_valid=2 gives a lone row no signal at all."""
    batch = build_padded([row("solo", 3.0), row("pair", 1.0), row("pair", 3.0)])
    adv = scalar_advantages(batch, min_valid=1)
    assert adv[0] == pytest.approx(3.0 / (1.0 + EPS))
    std = float(torch.tensor([1.0, 3.0]).std())
    assert adv[1:] == pytest.approx([-1.0 / (std + EPS), 1.0 / (std + EPS)])
    assert scalar_advantages(batch, norm_by_std=False, min_valid=1) == pytest.approx(
        [3.0, -1.0, 1.0]
    )
    assert scalar_advantages(batch)[0] == 0.0 and scalar_advantages(batch)[1:] == adv[1:]


def test_one_survivor_plus_placeholders_is_a_group_of_one() -> None:
    alone = scalar_advantages(build_padded([row("p", 0.5)]), min_valid=1)
    with_failures = scalar_advantages(
        build_padded([failed("p", 1), row("p", 0.5), failed("p", 2)]), min_valid=1
    )
    assert with_failures == [0.0, alone[0], 0.0]
    assert alone[0] == pytest.approx(0.5 / (1 + EPS))
    # below min_valid (default 2): the survivor's group gives no signal (NeMo-RL #4061, TRL #5902)
    assert scalar_advantages(build_padded([failed("p", 1), row("p", 0.5), failed("p", 2)])) == [
        0.0,
        0.0,
        0.0,
    ]


def test_min_valid_is_checked() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_valid"):
            grpo_outcome_advantage(build_padded([row("p", 1.0)]), min_valid=bad)


def test_excluded_placeholder_is_zero_even_if_its_mask_was_tampered() -> None:
    batch = build_padded([row("p", 1.0), failed("p"), row("p", 0.0)])
    batch["response_mask"][1, 0] = 1  # a hand-built batch breaking the placeholder contract
    assert grpo_outcome_advantage(batch)[1].abs().sum() == 0
    assert grpo_outcome_advantage(batch, exclude_placeholders=False)[1].abs().sum() > 0


def test_all_placeholder_group_is_all_zero() -> None:
    batch = build_padded([failed("p", 0), failed("p", 1), row("q", 1.0), row("q", 0.0)])
    adv = grpo_outcome_advantage(batch)
    assert adv[:2].abs().sum() == 0
    assert adv[2:].abs().sum() > 0
    # and without exclusion the placeholders are still masked out of the loss tokens
    assert grpo_outcome_advantage(batch, exclude_placeholders=False)[:2].abs().sum() == 0


def test_equal_scores_give_exact_zero() -> None:
    batch = build_padded([row("p", 0.1, index=i) for i in range(7)])
    assert grpo_outcome_advantage(batch).abs().sum() == 0


def test_advantage_is_broadcast_and_masked() -> None:
    batch = build_padded([row("p", 1.0, 4, mask=[1, 0, 1, 1]), row("p", 0.0, 2, mask=[1, 1])])
    adv = grpo_outcome_advantage(batch)
    a = adv[0, 0].item()
    assert a > 0
    assert adv[0].tolist() == [a, 0.0, a, a]
    assert adv[1].tolist() == [-a, -a, 0.0, 0.0]


def test_groups_are_keyed_by_uid_not_position() -> None:
    interleaved = build_padded([row("a", 1.0), row("b", 5.0), row("a", 0.0), row("b", 1.0)])
    adv = scalar_advantages(interleaved)
    assert adv[0] == pytest.approx(-adv[2]) and adv[1] == pytest.approx(-adv[3])
    assert adv[0] > 0 and adv[1] > 0


def test_missing_uid_is_an_error() -> None:
    bad = BatchRow(np.array([1]), np.array([1]), np.array([1]), None, 1.0, False, {"key": "x_0_0"})
    with pytest.raises(ValueError, match="uid"):
        grpo_outcome_advantage(build_padded([bad]))


def test_jagged_batch_must_be_densified() -> None:
    with pytest.raises(TypeError, match="densify"):
        grpo_outcome_advantage(build_jagged([row("p", 1.0)]))


def test_empty_batch() -> None:
    adv = grpo_outcome_advantage(build_padded([]))
    assert adv.shape == (0, 0) and adv.dtype == torch.float32
