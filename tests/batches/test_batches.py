"""Tests for sessions.batches: verl padding convention, jagged form, truncation, plain dicts."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions.batches import (
    NON_TENSOR_COLUMNS,
    UNKNOWN_TURNS,
    BatchRow,
    BatchTooLongError,
    build_jagged,
    build_padded,
    concat_batches,
    concat_padded,
    densify,
    from_plain_dict,
    non_tensor,
    select_rows,
    to_plain_dict,
)
from sessions.batches import flat as flat_module
from sessions.batches import padded as padded_module
from sessions.batches.tensordict_compat import NATIVE_JAGGED_ROW_OPS

pytestmark = pytest.mark.verl_env  # also under verl's pin, tensordict 0.10.0

FAST = settings(max_examples=50, deadline=None)
HEAVY = settings(max_examples=25, deadline=None)  # several builds + a torch.save per example
TENSOR_KEYS = {
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rm_scores",
    "prompt_length",
    "response_length",
    "is_placeholder",
    "num_turns",
}


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def make_row(
    prompt: list[int],
    response: list[int],
    mask: list[int] | None = None,
    reward: float = 1.0,
    logprobs: list[float] | None = None,
    *,
    key: str = "u0_0_0",
    uid: str = "u0",
    **meta: Any,
) -> BatchRow:
    mask = [1] * len(response) if mask is None else mask
    return BatchRow(
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        response_ids=np.asarray(response, dtype=np.int32),
        response_mask=np.asarray(mask, dtype=np.uint8),
        logprobs=None if logprobs is None else np.asarray(logprobs, dtype=np.float32),
        reward=reward,
        is_placeholder=False,
        meta={"key": key, "uid": uid, **meta},
    )


def placeholder(
    token: int = 7, *, key: str = "u0_1_0", uid: str = "u0", lp: bool = False
) -> BatchRow:
    """docs/design.md §5 placeholder: 1 prompt + 1 response token, mask 0, reward 0."""
    return BatchRow(
        prompt_ids=np.asarray([token], dtype=np.int32),
        response_ids=np.asarray([token], dtype=np.int32),
        response_mask=np.asarray([0], dtype=np.uint8),
        logprobs=np.asarray([0.0], dtype=np.float32) if lp else None,
        reward=0.0,
        is_placeholder=True,
        meta={
            "key": key,
            "uid": uid,
            "failure_reason": "timeout",
            "materialization_reason": "session_failed",
        },
    )


@st.composite
def batch_rows(draw: st.DrawFn, min_size: int = 1, max_size: int = 8) -> list[BatchRow]:
    """Random rows; hypothesis draws the shape (lengths, kinds, rewards), a seeded rng the tokens."""
    n = draw(st.integers(min_size, max_size))
    with_logprobs = draw(st.sampled_from(["none", "some", "all"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for i in range(n):
        key, uid = f"u{i % 3}_{i}_0", f"u{i % 3}"
        if draw(st.integers(0, 3)) == 0:
            rows.append(
                placeholder(int(rng.integers(1, 100)), key=key, uid=uid, lp=with_logprobs == "all")
            )
            continue
        p_len, r_len = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        lp = None
        if with_logprobs == "all" or (with_logprobs == "some" and draw(st.booleans())):
            lp = (-rng.exponential(size=r_len)).astype(np.float32).tolist()
        rows.append(
            make_row(
                rng.integers(1, 100, p_len).tolist(),
                rng.integers(1, 100, r_len).tolist(),
                rng.integers(0, 2, r_len).tolist(),
                draw(
                    st.floats(-10, 10, allow_nan=False, allow_infinity=False, allow_subnormal=False)
                ),
                lp,
                key=key,
                uid=uid,
                session_index=i,
                data_source="math",
                **({"num_turns": draw(st.integers(0, 5))} if draw(st.booleans()) else {}),
            )
        )
    return rows


def reference_padded(rows: list[BatchRow], pad: int) -> dict[str, torch.Tensor]:
    """Straightforward per-row padding with F.pad, then stack (the thing we must equal)."""
    P = max(len(r.prompt_ids) for r in rows)
    R = max(len(r.response_ids) for r in rows)
    any_lp = any(r.logprobs is not None for r in rows)
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in TENSOR_KEYS | {"rollout_log_probs"}}
    for r in rows:
        p = torch.as_tensor(r.prompt_ids, dtype=torch.int64)
        s = torch.as_tensor(r.response_ids, dtype=torch.int64)
        lp_, lr = len(p), len(s)
        cols["prompts"].append(F.pad(p, (P - lp_, 0), value=pad))
        cols["responses"].append(F.pad(s, (0, R - lr), value=pad))
        cols["input_ids"].append(torch.cat([cols["prompts"][-1], cols["responses"][-1]]))
        attn = torch.cat([F.pad(torch.ones(lp_), (P - lp_, 0)), F.pad(torch.ones(lr), (0, R - lr))])
        cols["attention_mask"].append(attn.long())
        pos = torch.zeros(P + R, dtype=torch.int64)  # left pad 0, real 0..n-1, right pad n-1
        pos[P - lp_ : P + lr] = torch.arange(lp_ + lr)
        pos[P + lr :] = lp_ + lr - 1
        cols["position_ids"].append(pos)
        mask = torch.as_tensor(r.response_mask, dtype=torch.int64)
        cols["response_mask"].append(F.pad(mask, (0, R - lr)))
        rm = torch.zeros(R, dtype=torch.float32)
        rm[lr - 1] = float(r.reward)  # stored as float32, like np.float32(reward)
        cols["rm_scores"].append(rm)
        lp = torch.zeros(lr) if r.logprobs is None else torch.as_tensor(r.logprobs)
        cols["rollout_log_probs"].append(F.pad(lp.float(), (0, R - lr)))
        cols["prompt_length"].append(torch.tensor(float(lp_)))  # float32, as verl reads them
        cols["response_length"].append(torch.tensor(float(lr)))
        cols["is_placeholder"].append(torch.tensor(r.is_placeholder))
        turns = r.meta.get("num_turns")
        cols["num_turns"].append(
            torch.tensor(turns if turns is not None else 0 if r.is_placeholder else UNKNOWN_TURNS)
        )
    out = {k: torch.stack(v) for k, v in cols.items()}
    if not any_lp:
        del out["rollout_log_probs"]
    return out


def tensor_keys(batch: Any) -> set[str]:
    return {k for k in batch.keys() if isinstance(batch.get(k), torch.Tensor)}


def assert_same_batch(a: Any, b: Any) -> None:
    assert tensor_keys(a) == tensor_keys(b)
    for k in tensor_keys(a):
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    for name in NON_TENSOR_COLUMNS:
        assert non_tensor(a, name) == non_tensor(b, name), name


def torch_roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------------------------------------------
# padded layout
# ------------------------------------------------------------------------------------------


@FAST
@given(rows=batch_rows(), pad=st.integers(0, 5))
def test_padded_matches_per_row_reference(rows: list[BatchRow], pad: int) -> None:
    batch = build_padded(rows, pad_token_id=pad)
    ref = reference_padded(rows, pad)
    assert batch.batch_size == torch.Size([len(rows)])
    assert tensor_keys(batch) == set(ref)
    for k, expected in ref.items():
        assert batch[k].dtype == expected.dtype, k
        assert torch.equal(batch[k], expected), k


@FAST
@given(rows=batch_rows())
def test_padded_row_invariants(rows: list[BatchRow]) -> None:
    batch = build_padded(rows, pad_token_id=0)
    P = batch["prompts"].shape[1]
    for i, row in enumerate(rows):
        lp, lr = len(row.prompt_ids), len(row.response_ids)
        assert batch["prompts"][i, P - lp :].tolist() == row.prompt_ids.tolist()
        assert not batch["prompts"][i, : P - lp].any()
        assert batch["responses"][i, :lr].tolist() == row.response_ids.tolist()
        assert not batch["responses"][i, lr:].any()
        assert int(batch["attention_mask"][i].sum()) == lp + lr
        nonzero = batch["rm_scores"][i].nonzero().flatten().tolist()
        assert nonzero == ([lr - 1] if np.float32(row.reward) != 0 else [])
        assert batch["rm_scores"][i, lr - 1].item() == np.float32(row.reward)
        assert batch["position_ids"][i, P - lp : P + lr].tolist() == list(range(lp + lr))
        assert not batch["response_mask"][i, lr:].any()
        if row.is_placeholder:
            assert not batch["response_mask"][i].any()
        assert (
            batch["input_ids"][i].tolist()
            == batch["prompts"][i].tolist() + batch["responses"][i].tolist()
        )
    assert non_tensor(batch, "key") == [r.meta["key"] for r in rows]
    assert batch["uid"] == [r.meta["uid"] for r in rows]


@FAST
@given(rows=batch_rows())
def test_score_mean_matches_verl_critic_score_mean(rows: list[BatchRow]) -> None:
    """verl: score = token_level_scores.sum(-1) over rows whose attended response length > 0."""
    batch = build_padded(rows)
    R = batch["responses"].shape[1]
    response_length = batch["attention_mask"][:, -R:].sum(-1)
    scores = batch["rm_scores"].sum(-1)[response_length > 0]
    rewards = np.asarray([r.reward for r in rows], dtype=np.float32)
    assert scores.numel() == len(rows)  # placeholders count (as zeros), none is "aborted"
    assert scores.double().mean().item() == pytest.approx(
        rewards.astype(np.float64).mean(), abs=1e-5
    )


def test_placeholder_attends_exactly_its_two_tokens() -> None:
    rows = [make_row([1, 2, 3, 4], [5, 6, 7], reward=1.0), placeholder(9, lp=True)]
    batch = build_padded(rows, pad_token_id=0)
    P = batch["prompts"].shape[1]
    attn = batch["attention_mask"][1]
    assert attn.nonzero().flatten().tolist() == [P - 1, P]
    assert batch["input_ids"][1, P - 1 : P + 1].tolist() == [9, 9]
    assert batch["response_mask"][1].tolist() == [0, 0, 0]
    assert batch["rm_scores"][1].tolist() == [0.0, 0.0, 0.0]
    assert batch["rollout_log_probs"][1].tolist() == [0.0, 0.0, 0.0]
    assert batch["is_placeholder"].tolist() == [False, True]
    assert batch["response_length"].tolist() == [3, 1]
    assert non_tensor(batch, "materialization_reason") == [None, "session_failed"]
    assert non_tensor(batch, "failure_reason") == [None, "timeout"]


def test_logprobs_column_only_when_some_row_has_them() -> None:
    without = build_padded([make_row([1], [2, 3])])
    assert "rollout_log_probs" not in without.keys()
    with_lp = build_padded([make_row([1], [2, 3], logprobs=[-0.5, -1.5]), make_row([1], [4])])
    assert with_lp["rollout_log_probs"].dtype == torch.float32
    assert with_lp["rollout_log_probs"].tolist() == [[-0.5, -1.5], [0.0, 0.0]]


def test_empty_response_keeps_reward_out_of_padding() -> None:
    """verl #6310: length-0 response must not put the reward at index -1 (padding)."""
    batch = build_padded([make_row([1, 2], [], reward=5.0), make_row([1], [3, 4], reward=1.0)])
    assert batch["rm_scores"].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert batch["response_length"].tolist() == [0, 2]


# ------------------------------------------------------------------------------------------
# loss masking with a tiny model
# ------------------------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """Embedding + linear head: position-independent, so padding cannot change a row's loss."""

    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def masked_token_loss(model: TinyLM, batch: Any) -> torch.Tensor:
    """Sum over response tokens of next-token CE * response_mask (verl's masked loss, unnormalised)."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(batch["input_ids"])[:, P - 1 : P + R - 1]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["responses"].reshape(-1), reduction="none"
    )
    return (ce.view(-1, R) * batch["response_mask"]).sum()


def grads(model: TinyLM, batch: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=False)
    masked_token_loss(model, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_placeholder_rows_contribute_exactly_zero_gradient() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    real = [
        make_row([1, 2, 3], [4, 5, 6], [1, 0, 1], key="u0_0_0"),
        make_row([7], [8, 9], key="u1_0_0"),
    ]
    fails = [placeholder(3, key="u0_1_0"), placeholder(11, key="u1_1_0", uid="u1")]
    batch = build_padded(real + fails)
    is_ph = batch["is_placeholder"]

    only_placeholders = grads(model, batch[is_ph])
    assert all(torch.count_nonzero(g) == 0 for g in only_placeholders)

    only_real = grads(model, batch[~is_ph])
    assert any(torch.count_nonzero(g) > 0 for g in only_real)

    everything = grads(model, batch)
    for g_all, g_real in zip(everything, only_real):
        torch.testing.assert_close(g_all, g_real)


# ------------------------------------------------------------------------------------------
# length limits and truncation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("builder", [build_padded, build_jagged])
def test_over_long_prompt_raises_naming_key(builder: Any) -> None:
    rows = [make_row([1, 2], [3], key="ok_0_0"), make_row(list(range(1, 11)), [3], key="long_0_0")]
    with pytest.raises(BatchTooLongError) as err:
        builder(rows, max_prompt_length=4)
    msg = str(err.value)
    assert "long_0_0" in msg and "prompt" in msg and "10" in msg and "4" in msg
    assert "truncate=True" in msg
    assert (err.value.key, err.value.side, err.value.length, err.value.limit) == (
        "long_0_0",
        "prompt",
        10,
        4,
    )
    assert isinstance(err.value, ValueError)


def test_over_long_response_raises_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_concat(*_: Any, **__: Any) -> None:
        raise AssertionError("tensors were built before the length check")

    monkeypatch.setattr(flat_module, "_concat", no_concat)  # the jagged builder's flat columns
    monkeypatch.setattr(padded_module, "_empty", no_concat)  # the padded writer's outputs
    with pytest.raises(
        BatchTooLongError, match="r_0_0.*response length 5 exceeds max_response_length=3"
    ):
        build_padded([make_row([1], [1, 2, 3, 4, 5], key="r_0_0")], max_response_length=3)


def test_within_limits_is_untouched() -> None:
    rows = [make_row([1, 2, 3], [4, 5], reward=2.0)]
    assert_same_batch(
        build_padded(rows, max_prompt_length=3, max_response_length=2), build_padded(rows)
    )


def test_truncate_keeps_prompt_tail_and_response_head() -> None:
    row = make_row(
        list(range(1, 11)),
        list(range(11, 21)),
        [1, 0, 1, 1, 0, 1, 1, 1, 1, 1],
        reward=3.0,
        logprobs=[-float(i) for i in range(10)],
    )
    batch = build_padded([row], max_prompt_length=4, max_response_length=3, truncate=True)
    assert batch["prompts"].tolist() == [[7, 8, 9, 10]]
    assert batch["responses"].tolist() == [[11, 12, 13]]
    assert batch["response_mask"].tolist() == [[1, 0, 1]]
    assert batch["rollout_log_probs"].tolist() == [[0.0, -1.0, -2.0]]
    assert batch["rm_scores"].tolist() == [[0.0, 0.0, 3.0]]
    assert batch["prompt_length"].tolist() == [4] and batch["response_length"].tolist() == [3]
    assert batch["input_ids"].tolist() == [[7, 8, 9, 10, 11, 12, 13]]


def cut(row: BatchRow, max_p: int, max_r: int) -> BatchRow:
    return BatchRow(
        prompt_ids=row.prompt_ids[-max_p:],
        response_ids=row.response_ids[:max_r],
        response_mask=row.response_mask[:max_r],
        logprobs=None if row.logprobs is None else row.logprobs[:max_r],
        reward=row.reward,
        is_placeholder=row.is_placeholder,
        meta=row.meta,
    )


@FAST
@given(rows=batch_rows(), max_p=st.integers(1, 40), max_r=st.integers(1, 40))
def test_truncate_equals_building_pre_cut_rows(
    rows: list[BatchRow], max_p: int, max_r: int
) -> None:
    expected = [cut(r, max_p, max_r) for r in rows]
    got = build_padded(rows, max_prompt_length=max_p, max_response_length=max_r, truncate=True)
    assert_same_batch(got, build_padded(expected))
    got_j = build_jagged(rows, max_prompt_length=max_p, max_response_length=max_r, truncate=True)
    assert_same_batch(densify(got_j), build_padded(expected))


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


def test_mask_length_mismatch_names_key() -> None:
    with pytest.raises(ValueError, match="bad_0_0.*response_mask length 1 != response length 2"):
        build_padded([make_row([1], [2, 3], [1], key="bad_0_0")])


def test_logprobs_length_mismatch_names_key() -> None:
    with pytest.raises(ValueError, match="badlp_0_0.*logprobs length 3"):
        build_padded([make_row([1], [2, 3], logprobs=[0.0, 0.0, 0.0], key="badlp_0_0")])


def test_mask_values_must_be_binary() -> None:
    rows = [make_row([1], [2], key="a_0_0"), make_row([1], [2, 3], [1, 2], key="two_0_0")]
    with pytest.raises(ValueError, match="two_0_0.*0 or 1"):
        build_padded(rows)


def test_placeholder_with_trainable_tokens_is_rejected() -> None:
    bad = BatchRow(np.array([1]), np.array([2]), np.array([1]), None, 0.0, True, {"key": "ph_0_0"})
    with pytest.raises(ValueError, match="ph_0_0.*placeholder"):
        build_padded([make_row([1], [2]), bad])


def test_non_integer_ids_rejected() -> None:
    bad = BatchRow(
        np.array([1.5]), np.array([2]), np.array([1]), None, 0.0, False, {"key": "f_0_0"}
    )
    with pytest.raises(ValueError, match="f_0_0.*prompt_ids"):
        build_padded([bad])


@pytest.mark.parametrize("limit", [0, -1, 2.5])
def test_bad_limit_rejected(limit: Any) -> None:
    with pytest.raises(ValueError, match="max_prompt_length"):
        build_padded([make_row([1], [2])], max_prompt_length=limit)


# ------------------------------------------------------------------------------------------
# non-tensor columns
# ------------------------------------------------------------------------------------------


def test_non_tensor_columns_roundtrip_and_follow_indexing() -> None:
    rows = [
        make_row([1], [2], key=f"u{i}_0_0", uid=f"u{i}", session_index=np.int64(i), global_step=3)
        for i in range(4)
    ]
    batch = build_padded(rows)
    for name in NON_TENSOR_COLUMNS:
        assert name in batch.keys()
        assert len(non_tensor(batch, name)) == 4
    assert non_tensor(batch, "uid") == ["u0", "u1", "u2", "u3"]
    assert non_tensor(batch, "session_index") == [0, 1, 2, 3]
    assert all(type(v) is int for v in non_tensor(batch, "session_index"))
    assert non_tensor(batch, "run") == [None] * 4
    assert batch.get_non_tensor("key") == ["u0_0_0", "u1_0_0", "u2_0_0", "u3_0_0"]
    picked = batch[torch.tensor([2, 0])]
    assert non_tensor(picked, "uid") == ["u2", "u0"]
    assert picked["prompt_length"].tolist() == [1, 1]
    assert non_tensor(batch[batch["prompt_length"] > 5], "uid") == []
    assert non_tensor(torch.cat([batch, batch[1:2]]), "uid") == ["u0", "u1", "u2", "u3", "u1"]


def test_non_tensor_helper_broadcasts_set_non_tensor_scalar() -> None:
    batch = build_padded([make_row([1], [2]), make_row([1], [2])])
    batch.set_non_tensor("note", "same")
    assert non_tensor(batch, "note") == ["same", "same"]
    with pytest.raises(TypeError):
        non_tensor(batch, "prompts")


# ------------------------------------------------------------------------------------------
# empty batches and concatenation
# ------------------------------------------------------------------------------------------


def test_empty_rows_give_zero_width_batch_with_all_keys() -> None:
    empty = build_padded([])
    assert empty.batch_size == torch.Size([0])
    assert tensor_keys(empty) == TENSOR_KEYS
    assert empty["prompts"].shape == (0, 0) and empty["input_ids"].shape == (0, 0)
    assert empty["rm_scores"].dtype == torch.float32
    assert non_tensor(empty, "uid") == []
    jagged = build_jagged([])
    assert jagged.batch_size == torch.Size([0])
    assert_same_batch(densify(jagged), empty)


@HEAVY
@given(a=batch_rows(min_size=0, max_size=5), b=batch_rows(min_size=0, max_size=5))
def test_concat_padded_equals_building_all_rows(a: list[BatchRow], b: list[BatchRow]) -> None:
    expected = build_padded(a + b, pad_token_id=3)
    got = concat_padded(
        [build_padded(a, pad_token_id=3), build_padded(b, pad_token_id=3)], pad_token_id=3
    )
    assert_same_batch(got, expected)
    mixed = concat_padded([build_jagged(a), build_padded(b, pad_token_id=3)], pad_token_id=3)
    assert_same_batch(mixed, expected)
    # jagged batches with the same columns concatenate with concat_batches (any tensordict)
    # and, where tensordict does it for nested tensors (0.15.3, not 0.10.0), plain torch.cat
    ja, jb = build_jagged(a), build_jagged(b)
    if set(ja.keys()) == set(jb.keys()):
        assert_same_batch(densify(concat_batches([ja, jb]), pad_token_id=3), expected)
        if NATIVE_JAGGED_ROW_OPS:
            assert_same_batch(densify(torch.cat([ja, jb]), pad_token_id=3), expected)


def test_concat_padded_of_nothing_is_empty_batch() -> None:
    assert_same_batch(concat_padded([]), build_padded([]))


# ------------------------------------------------------------------------------------------
# jagged layout
# ------------------------------------------------------------------------------------------


@FAST
@given(rows=batch_rows(), pad=st.integers(0, 5))
def test_densify_equals_padded(rows: list[BatchRow], pad: int) -> None:
    assert_same_batch(
        densify(build_jagged(rows), pad_token_id=pad), build_padded(rows, pad_token_id=pad)
    )


@FAST
@given(rows=batch_rows())
def test_jagged_rows_are_unpadded(rows: list[BatchRow]) -> None:
    batch = build_jagged(rows)
    names = (
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "rm_scores",
    )
    per_row = {}
    for name in names:
        assert batch[name].layout == torch.jagged, name
        per_row[name] = [t.tolist() for t in batch[name].unbind()]
    for i, row in enumerate(rows):
        p, r = row.prompt_ids.tolist(), row.response_ids.tolist()
        rm = [0.0] * len(r)
        rm[-1] = float(np.float32(row.reward))
        assert per_row["prompts"][i] == p
        assert per_row["responses"][i] == r
        assert per_row["input_ids"][i] == p + r
        assert per_row["attention_mask"][i] == [1] * (len(p) + len(r))
        assert per_row["position_ids"][i] == list(range(len(p) + len(r)))
        assert per_row["response_mask"][i] == row.response_mask.tolist()
        assert per_row["rm_scores"][i] == rm
    assert non_tensor(batch, "key") == [r.meta["key"] for r in rows]


def test_densify_after_reordering_rows() -> None:
    rows = [
        make_row([1, 2, 3], [4], key="a_0_0"),
        make_row([5], [6, 7, 8], key="b_0_0"),
        placeholder(9),
    ]
    order = torch.tensor([2, 0, 1])
    expected = build_padded([rows[i] for i in order.tolist()])
    assert_same_batch(densify(select_rows(build_jagged(rows), order)), expected)
    if NATIVE_JAGGED_ROW_OPS:  # tensordict 0.15.3 indexes jagged batches itself; 0.10.0 cannot
        assert_same_batch(densify(build_jagged(rows)[order]), expected)


def test_densify_rejects_unknown_token_columns() -> None:
    batch = build_jagged([make_row([1], [2])])
    batch["advantages"] = torch.nested.nested_tensor_from_jagged(
        torch.zeros(1), torch.tensor([0, 1])
    )
    with pytest.raises(ValueError, match="advantages"):
        densify(batch)


# ------------------------------------------------------------------------------------------
# plain dicts
# ------------------------------------------------------------------------------------------


@HEAVY
@given(rows=batch_rows(min_size=0))
def test_plain_dict_roundtrips_weights_only(rows: list[BatchRow]) -> None:
    padded, jagged = build_padded(rows), build_jagged(rows)

    plain = torch_roundtrip(to_plain_dict(padded))
    assert set(plain) == tensor_keys(padded) | set(NON_TENSOR_COLUMNS)
    assert plain["uid"] == non_tensor(padded, "uid")
    assert_same_batch(from_plain_dict(plain), padded)

    plain_j = torch_roundtrip(to_plain_dict(jagged))
    assert "prompts" not in plain_j
    assert torch.equal(
        plain_j["prompts.offsets"],
        torch.tensor([0] + np.cumsum([len(r.prompt_ids) for r in rows]).tolist()),
    )
    assert plain_j["prompts.values"].tolist() == [t for r in rows for t in r.prompt_ids.tolist()]
    assert plain_j["prompt_length"].tolist() == [len(r.prompt_ids) for r in rows]
    assert_same_batch(densify(from_plain_dict(plain_j)), padded)


def test_plain_dict_rejects_unloadable_meta() -> None:
    batch = build_padded([make_row([1], [2], data_source=object())])
    with pytest.raises(TypeError, match="data_source"):
        to_plain_dict(batch)


# ------------------------------------------------------------------------------------------
# scale
# ------------------------------------------------------------------------------------------


def test_large_batch_builds_quickly() -> None:
    """Vectorised padding: 2,048 rows x ~1k tokens must not take per-token Python time."""
    import time

    rng = np.random.default_rng(0)
    rows = [
        BatchRow(
            rng.integers(0, 1000, rng.integers(1, 512), dtype=np.int32),
            (resp := rng.integers(0, 1000, rng.integers(1, 512), dtype=np.int32)),
            np.ones(resp.shape[0], np.uint8),
            None,
            1.0,
            False,
            {"key": f"k{i}_0_0", "uid": f"k{i}"},
        )
        for i in range(2048)
    ]
    start = time.perf_counter()
    batch = build_padded(rows)
    elapsed = time.perf_counter() - start
    assert batch["rm_scores"].sum().item() == 2048.0
    assert elapsed < 5.0, elapsed
