"""sessions.integrations.verl in verl 0.9.1's training step, on steps recorded through the public
API (both backends): fixed batch sizes (60 and 62 rows padded for chunk, _balance_batch and the
worker's mini-batch iterator), metrics that skip filler rows, the seq-mean loss modes run through
verl's own worker loss (``ppo_loss``) with and without the fix, and rollout_corr diagnostics.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack

from sessions.batches import non_tensor
from sessions.integrations.verl import (
    IS_PADDING,
    SEQ_MEAN_MODES,
    patch_rollout_corr_metrics,
    rollout_corr_metrics,
    seq_mean_weights,
    to_data_proto,
    trainable_rows,
    unbiased_seq_mean,
    without_padding,
)
from tests.integrations.verl.scenarios import demo_like_plan, new_run, recorded_batches

pytestmark = pytest.mark.verl_env

MODES = ("token-mean", *SEQ_MEAN_MODES)
EXAMPLES = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def steps(module_db_url: str) -> dict[str, Any]:
    """Three train steps of 16 groups of 4: 4 cancelled (60 rows), 2 cancelled (62 rows), and one
    with sandbox failures dropped by the policy and sessions of up to 3 rows."""
    plans = [
        ("train", 0, demo_like_plan(16, 4, cancelled=4, seed=1)),
        ("train", 1, demo_like_plan(16, 4, cancelled=2, seed=2)),
        (
            "train",
            2,
            demo_like_plan(
                16,
                4,
                cancelled=3,
                seed=3,
                failure_kinds=("error", "sandbox", "timeout"),
                max_rows=3,
            ),
        ),
    ]
    batches, _ = asyncio.run(recorded_batches(module_db_url, new_run("vt"), plans))
    assert [b.batch_size[0] for b in batches[:2]] == [60, 62]
    return {"60": batches[0], "62": batches[1], "mixed": batches[2]}


def grpo(dp: Any) -> Any:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    dp.batch["token_level_scores"] = dp.batch["token_level_rewards"] = dp.batch["rm_scores"]
    dp.batch["advantages"], dp.batch["returns"] = compute_grpo_outcome_advantage(
        dp.batch["rm_scores"], dp.batch["response_mask"], dp.non_tensor_batch["uid"]
    )
    return dp


def balance(dp: Any, dp_size: int) -> dict[str, Any]:
    """RayPPOTrainer._balance_batch as the trainer calls it (it reads only the actor's dp size)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = types.SimpleNamespace(
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))}),
        use_prefix_grouper=False,
    )
    trainer._get_dp_size = types.MethodType(RayPPOTrainer._get_dp_size, trainer)
    metrics: dict[str, Any] = {}
    RayPPOTrainer._balance_batch(trainer, dp, metrics=metrics)
    return metrics


# ------------------------------------------------------------------ fixed batch size
@pytest.mark.parametrize(("name", "multiple"), [("60", 64), ("62", 64), ("60", 4), ("62", 2)])
def test_padding_makes_verls_fixed_multiples_work(
    verl_installed: None, steps: dict[str, Any], name: str, multiple: int
) -> None:
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = steps[name]
    size = batch.batch_size[0]
    plain = to_data_proto(batch)
    with pytest.raises(AssertionError):  # what verl does with a batch of 60 or 62 rows
        plain.chunk(64)
    dp = to_data_proto(batch, pad_to_multiple=multiple, pad_token_id=7)
    padded = len(dp)
    assert padded % multiple == 0 and 0 <= padded - size < multiple
    filler = slice(size, padded)
    P = batch["prompts"].shape[1]
    for key in plain.batch.keys():  # every column, its dtype, the real rows untouched
        assert dp.batch[key].dtype == plain.batch[key].dtype and torch.equal(
            dp.batch[key][:size], plain.batch[key]
        )
    for key in ("prompts", "responses", "input_ids"):
        assert (dp.batch[key][filler] == 7).all()
    attention = dp.batch["attention_mask"][filler]
    assert (
        (attention.sum(-1) == 2).all()
        and (attention[:, P - 1] == 1).all()
        and (attention[:, P] == 1).all()
    )
    assert (
        dp.batch["position_ids"][filler] == (torch.arange(attention.shape[1]) >= P).long()
    ).all()
    for key in ("response_mask", "rm_scores", "rollout_log_probs", "is_placeholder"):
        assert not dp.batch[key][filler].any(), key
    assert (dp.batch["prompt_length"][filler] == 1).all() and (
        dp.batch["response_length"][filler] == 1
    ).all()
    assert dp.batch[IS_PADDING][filler].all() and not dp.batch[IS_PADDING][:size].any()
    uids = dp.non_tensor_batch["uid"][filler].tolist()
    assert len(set(uids)) == len(uids) and not set(uids) & set(
        plain.non_tensor_batch["uid"].tolist()
    )
    assert all("_" not in uid for uid in uids)
    assert dp.non_tensor_batch["key"][filler].tolist() == [f"{uid}_0_0" for uid in uids]
    for key, values in dp.non_tensor_batch.items():
        assert (
            values.dtype == object
            and values.shape == (padded,)
            and values[:size].tolist() == plain.non_tensor_batch[key].tolist()
        )

    # what the trainer then does: chunk per rank, balance, mini-batches in the worker
    assert [len(c) for c in dp.chunk(multiple)] == [padded // multiple] * multiple
    dp_size = 2 if multiple % 2 == 0 else 1
    balance(dp, dp_size)
    assert sorted(dp.non_tensor_batch["key"].tolist()) == sorted(
        to_data_proto(batch, pad_to_multiple=multiple).non_tensor_batch["key"].tolist()
    )
    worker = left_right_2_no_padding(dp.to_tensordict())
    mini_batches = list(tu.make_iterator(worker, mini_batch_size=multiple, epochs=1))
    assert sum(m.batch_size[0] for m in mini_batches) == padded

    # GRPO: filler rows get exactly 0, real rows what they get unpadded
    grpo(dp)
    grpo(plain)
    real = ~dp.batch[IS_PADDING]
    assert not dp.batch["advantages"][~real].any()
    order = {key: i for i, key in enumerate(plain.non_tensor_batch["key"].tolist())}
    back = torch.tensor([order[key] for key in dp.non_tensor_batch["key"][real.numpy()].tolist()])
    torch.testing.assert_close(dp.batch["advantages"][real], plain.batch["advantages"][back])

    # metrics: verl counts filler rows like any row; without_padding gives back the unpadded figures
    counted = compute_data_metrics(dp, use_critic=False)
    assert counted["critic/score/mean"] == pytest.approx(
        float(plain.batch["rm_scores"].sum()) / padded, abs=1e-6
    )
    honest = compute_data_metrics(without_padding(dp), use_critic=False)
    unpadded = compute_data_metrics(plain, use_critic=False)
    assert honest.keys() == unpadded.keys()
    for key, value in unpadded.items():
        assert honest[key] == pytest.approx(value, abs=1e-6), key


@EXAMPLES
@given(data=st.data(), multiple=st.integers(1, 40), name=st.sampled_from(["60", "62", "mixed"]))
def test_any_subset_pads_to_any_multiple(
    verl_installed: None, steps: dict[str, Any], data: st.DataObject, multiple: int, name: str
) -> None:
    """Any selection of a recorded step's rows pads to any multiple, filler rows train nothing and
    are removed exactly by without_padding."""
    from verl.protocol import DataProto

    batch = steps[name]
    rows = data.draw(
        st.lists(st.integers(0, batch.batch_size[0] - 1), min_size=1, max_size=70, unique=True)
    )
    subset = batch[torch.tensor(rows)]
    dp = grpo(to_data_proto(subset, pad_to_multiple=multiple))
    assert len(dp) % multiple == 0 and len(dp) - len(rows) < multiple
    filler = dp.batch[IS_PADDING]
    assert int(filler.sum()) == len(dp) - len(rows)
    assert not dp.batch["response_mask"][filler].any() and not dp.batch["advantages"][filler].any()
    kept = without_padding(dp)
    assert kept.non_tensor_batch["key"].tolist() == non_tensor(subset, "key")
    assert isinstance(DataProto.concat(dp.chunk(multiple)), DataProto)


def test_padding_refuses_what_it_cannot_do(verl_installed: None, steps: dict[str, Any]) -> None:
    batch = steps["60"]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="pad_to_multiple"):
            to_data_proto(batch, pad_to_multiple=bad)
    padded = to_data_proto(batch, pad_to_multiple=64)
    assert padded.non_tensor_batch["uid"][-1] == "pad-0-3"
    mixed = batch.clone()
    mixed.set("partition", NonTensorStack.from_list(["train"] * 59 + ["val"]))
    with pytest.raises(ValueError, match="mixes partitions"):
        to_data_proto(mixed)
    jagged = batch.clone()
    jagged.set(
        "responses", torch.nested.as_nested_tensor(list(batch["responses"]), layout=torch.jagged)
    )
    with pytest.raises(TypeError, match="'responses' is jagged.*densify"):
        to_data_proto(jagged)


# ------------------------------------------------------------------ seq-mean loss modes
def worker_loss(
    dp: Any,
    leaf: torch.Tensor,
    rows: list[torch.Tensor],
    *,
    mode: str,
    global_batch_size: int | None,
    dp_size: int,
) -> torch.Tensor:
    """One mini-batch's loss as verl's worker computes it: ``rows[r]`` are rank r's rows of the
    mini-batch, each rank runs verl's ``ppo_loss`` with the global token count, the dp size and
    ``global_batch_size`` (None: as agg_loss without global info), and data-parallel training
    averages the ranks' gradients, i.e. differentiates the mean of their losses."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    config = actor_config(mode)
    tokens = int(sum(dp.batch["response_mask"][r].sum() for r in rows))
    losses = []
    for r in rows:
        td = left_right_2_no_padding(dp.select_idxs(r).to_tensordict())
        attended = dp.batch["attention_mask"][r].bool()
        log_probs = leaf[r][attended]  # the model's output over the unpadded tokens, row after row
        tu.assign_non_tensor(
            td, dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=global_batch_size
        )
        loss, _ = ppo_loss(config, {"log_probs": log_probs}, td)
        losses.append(loss)
    return torch.stack(losses).mean()


@functools.cache
def actor_config(mode: str) -> Any:
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=mode,
        use_torch_compile=False,
    )


def rank_rows(size: int, mini_batch_size: int, dp_size: int) -> list[list[torch.Tensor]]:
    """Per mini-batch, per rank, the row indices verl's worker puts there (shuffle off)."""
    shard, per_rank = size // dp_size, mini_batch_size // dp_size
    return [
        [
            torch.arange(r * shard + m * per_rank, r * shard + (m + 1) * per_rank)
            for r in range(dp_size)
        ]
        for m in range(shard // per_rank)
    ]


@EXAMPLES
@given(
    name=st.sampled_from(["60", "62", "mixed"]),
    mode=st.sampled_from(MODES),
    mini_batch_size=st.sampled_from([16, 32, 64]),
    dp_size=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_seq_mean_fix_gives_the_loss_over_trainable_rows(
    verl_installed: None,
    steps: dict[str, Any],
    name: str,
    mode: str,
    mini_batch_size: int,
    dp_size: int,
    seed: int,
) -> None:
    batch = steps[name]
    dp = grpo(to_data_proto(batch, pad_to_multiple=64))
    balance(dp, dp_size)
    generator = torch.Generator().manual_seed(seed)
    dp.batch["old_log_probs"] = dp.batch["rollout_log_probs"] - 0.05 * torch.rand(
        dp.batch["rollout_log_probs"].shape, generator=generator
    )
    size, width = len(dp), dp.batch["attention_mask"].shape[1]
    start = -torch.rand((size, width), generator=generator)
    trainable = dp.batch["response_mask"].sum(-1) > 0
    mini_batches = rank_rows(size, mini_batch_size, dp_size)

    def run(weighted: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        leaf = start.clone().requires_grad_(True)
        if weighted:
            with unbiased_seq_mean(
                dp, loss_agg_mode=mode, mini_batch_size=mini_batch_size, dp_size=dp_size
            ):
                losses = [
                    worker_loss(
                        dp,
                        leaf,
                        rows,
                        mode=mode,
                        global_batch_size=mini_batch_size,
                        dp_size=dp_size,
                    )
                    for rows in mini_batches
                ]
        else:
            losses = [
                worker_loss(
                    dp, leaf, rows, mode=mode, global_batch_size=mini_batch_size, dp_size=dp_size
                )
                for rows in mini_batches
            ]
        torch.stack(losses).sum().backward()
        return [loss.detach() for loss in losses], leaf.grad

    plain_losses, plain_grad = run(weighted=False)
    fixed_losses, fixed_grad = run(weighted=True)
    advantages_before = dp.batch["advantages"].clone()
    real_leaf = start.clone().requires_grad_(True)
    for m, rows in enumerate(mini_batches):
        real = torch.cat(rows)[trainable[torch.cat(rows)]]
        count = len(real)
        if count == 0:  # a mini-batch of placeholders and filler only: nothing to learn
            if mode in SEQ_MEAN_MODES:
                assert fixed_losses[m] == plain_losses[m] == 0
            else:  # verl's token-mean divides by the mini-batch's 0 tokens (its optimizer skips the step)
                assert fixed_losses[m].isnan() and plain_losses[m].isnan()
            continue
        real_loss = worker_loss(
            dp, real_leaf, [real], mode=mode, global_batch_size=None, dp_size=1
        )  # the mean over trainable rows
        assert fixed_losses[m] == pytest.approx(real_loss.item(), rel=1e-5, abs=1e-7)
        if mode in SEQ_MEAN_MODES:  # without the fix: scaled by the trainable share
            assert plain_losses[m] == pytest.approx(
                real_loss.item() * count / mini_batch_size, rel=1e-5, abs=1e-7
            )
        else:
            assert plain_losses[m] == pytest.approx(real_loss.item(), rel=1e-5, abs=1e-7)
        real_loss.backward()
    assert torch.equal(dp.batch["advantages"], advantages_before)  # restored after the block
    torch.testing.assert_close(
        fixed_grad[trainable], real_leaf.grad[trainable], rtol=1e-4, atol=1e-7
    )
    for grad in (plain_grad, fixed_grad):  # placeholder and filler rows: exactly no gradient
        in_nan_mini_batch = grad.isnan().all(
            -1
        )  # token-mean over a mini-batch without tokens (above)
        assert not grad[~trainable & ~in_nan_mini_batch].any()


def test_seq_mean_weights_refuse_what_verl_refuses(
    verl_installed: None, steps: dict[str, Any]
) -> None:
    mask = to_data_proto(steps["60"]).batch["response_mask"]
    assert torch.equal(
        seq_mean_weights(mask, loss_agg_mode="token-mean", mini_batch_size=64), torch.ones(60)
    )
    with pytest.raises(ValueError, match="pad_to_multiple=64"):
        seq_mean_weights(mask, loss_agg_mode="seq-mean-token-sum", mini_batch_size=64)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        seq_mean_weights(mask, loss_agg_mode="seq-mean", mini_batch_size=60)
    with pytest.raises(ValueError, match="multiple of dp_size"):
        seq_mean_weights(mask, loss_agg_mode="seq-mean-token-mean", mini_batch_size=30, dp_size=4)
    dp = to_data_proto(steps["60"], pad_to_multiple=64)
    with pytest.raises(ValueError, match="advantages"):
        with unbiased_seq_mean(dp, loss_agg_mode="seq-mean-token-sum", mini_batch_size=64):
            pass
    grpo(dp)
    before = dp.batch["advantages"]
    with pytest.raises(RuntimeError):
        with unbiased_seq_mean(
            dp, loss_agg_mode="seq-mean-token-sum", mini_batch_size=64
        ) as weights:
            assert weights[dp.batch[IS_PADDING]].eq(0).all()
            raise RuntimeError("the actor update failed")
    assert dp.batch["advantages"] is before


# ------------------------------------------------------------------ rollout_corr
@pytest.fixture
def restore_rollout_corr(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import verl.trainer.ppo.rollout_corr_helper as helper

    monkeypatch.setattr(
        helper,
        "compute_rollout_correction_and_add_to_batch",
        helper.compute_rollout_correction_and_add_to_batch,
    )
    yield helper


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_rollout_corr_metrics_over_trainable_rows(
    verl_installed: None, steps: dict[str, Any], restore_rollout_corr: Any, level: str
) -> None:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    helper = restore_rollout_corr
    stock = helper.compute_rollout_correction_and_add_to_batch
    config = RolloutCorrectionConfig(
        rollout_is=level,
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    batch = steps["mixed"]
    dp = to_data_proto(batch, pad_to_multiple=64)
    dp.batch["old_log_probs"] = dp.batch["rollout_log_probs"] - 0.2 * torch.rand(
        dp.batch["rollout_log_probs"].shape, generator=torch.Generator().manual_seed(5)
    )
    real = trainable_rows(dp)
    assert len(real) < len(dp)
    _, on_all = stock(copy.deepcopy(dp), config)
    _, on_real = stock(copy.deepcopy(real), config)
    ours = rollout_corr_metrics(dp, config)
    assert ours.keys() == on_real.keys() == on_all.keys()
    for key, value in on_real.items():
        assert ours[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    per_sequence = {
        "training_ppl",
        "training_log_ppl",
        "rollout_ppl",
        "rollout_log_ppl",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "ppl_ratio",
        "chi2_seq",
        "rollout_is_seq_mean",
        "rollout_is_seq_min",
    }
    for name in per_sequence:  # what verl gets wrong with placeholders in the batch
        assert on_all[f"rollout_corr/{name}"] != pytest.approx(
            on_real[f"rollout_corr/{name}"], rel=1e-6
        ), name
    for name in (
        "kl",
        "k3_kl",
        "chi2_token",
        "rollout_rs_masked_fraction",
    ):  # token-level: unaffected
        assert on_all[f"rollout_corr/{name}"] == pytest.approx(
            on_real[f"rollout_corr/{name}"], rel=1e-5
        ), name

    # the patch: verl's own batch (weights, rejection mask), the trainable-rows metrics; idempotent
    patch_rollout_corr_metrics()
    patch_rollout_corr_metrics()
    from verl.trainer.ppo.rollout_corr_helper import (
        compute_rollout_correction_and_add_to_batch as patched,
    )  # as fit imports it

    assert patched is not stock
    expected, _ = stock(copy.deepcopy(dp), config)
    got, metrics = patched(copy.deepcopy(dp), config)
    assert metrics == ours
    for key in expected.batch.keys():
        assert torch.equal(got.batch[key], expected.batch[key]), key
    assert not got.batch["response_mask"][dp.batch["response_mask"].sum(-1) == 0].any()
