"""The trainer side of verl (docs/design.md §5, §13): stock verl GRPO equals the
ledger's reference ``grpo_outcome_advantage(..., exclude_placeholders=True, min_valid=...)``.

* generated groups (hypothesis: sizes 1-6, placeholders anywhere, lone survivors, all-failed
  groups, ``min_valid`` 0-3, with and without std normalisation): a ledger batch through
  ``to_data_proto`` (placeholders isolated), verl's own ``compute_advantage(..., "grpo")`` and
  ``zero_below_min_valid`` gives the reference's advantages; so does ``ledger_grpo_advantage`` on
  a DataProto as verl's rollout builds it (placeholders flagged in the non-tensor column the
  ledger agent loop's ``extra_fields`` make);
* the issue's demo (``--fail-rate 0.3 --cancel-rate 0.1 --seed 23``), train step 0: stock GRPO
  differs from the reference on its lone survivors, the stock path with the fix does not;
* ``LedgerTrainerHook`` around an actor update: the fixed advantages, the seq-mean weights
  inside the update only, and the ledger's own figures for verl's tracker;
  ``LedgerRayPPOTrainer._update_actor`` calls it around verl's own (the actor worker group, the
  GPU training itself, is what the test stands in for).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions.batches import BatchRow, build_padded, non_tensor
from sessions.batches.advantage import grpo_outcome_advantage
from tests import REPO
from tests.conftest import require_verl

pytestmark = pytest.mark.verl_env
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def groups(draw: st.DrawFn) -> list[list[tuple[bool, float]]]:
    """Groups of (is_placeholder, reward); lone survivors and all-failed groups come up often."""
    reward = st.sampled_from([0.0, 0.25, 0.5, 1.0])
    out = []
    for _ in range(draw(st.integers(1, 6))):
        size = draw(st.integers(1, 6))
        failed = draw(st.sampled_from(["none", "all_but_one", "all", "some"]))
        rows = []
        for k in range(size):
            if failed == "none":
                placeholder = False
            elif failed == "all":
                placeholder = True
            elif failed == "all_but_one":
                placeholder = k != 0
            else:
                placeholder = draw(st.booleans())
            rows.append((placeholder, 0.0 if placeholder else draw(reward)))
        out.append(draw(st.permutations(rows)))
    return out


def ledger_batch(plan: list[list[tuple[bool, float]]]) -> Any:
    """A padded ledger batch of these groups, in the ledger's own layout."""
    rows = []
    for g, group in enumerate(plan):
        for k, (placeholder, reward) in enumerate(group):
            response = 1 if placeholder else 2 + (g + k) % 3
            rows.append(
                BatchRow(
                    prompt_ids=np.array([7] * (1 if placeholder else 3)),
                    response_ids=np.array([9] * response),
                    response_mask=np.array([0 if placeholder else 1] * response),
                    logprobs=None,
                    reward=reward,
                    is_placeholder=placeholder,
                    meta={
                        "uid": f"g{g}",
                        "session_index": k,
                        "partition": "train",
                        "key": f"g{g}_{k}_0",
                    },
                )
            )
    return build_padded(rows)


def verl_rollout_dp(batch: Any) -> Any:
    """The same rows as verl's own rollout would hand its trainer: tensors, the prompt's uid, and
    the ledger agent loop's placeholder flag as the non-tensor column verl makes of extra_fields."""
    from verl import DataProto

    flags = np.empty(batch.batch_size[0], dtype=object)
    flags[:] = [True if p else None for p in batch["is_placeholder"].tolist()]
    return DataProto.from_dict(
        tensors={
            "responses": batch["responses"],
            "response_mask": batch["response_mask"],
            "token_level_rewards": batch["rm_scores"],
        },
        non_tensors={
            "uid": np.array(non_tensor(batch, "uid"), dtype=object),
            "is_placeholder": flags,
        },
    )


def stock_grpo(dp: Any, norm: bool) -> Any:
    from verl.trainer.ppo.ray_trainer import compute_advantage

    dp.batch["token_level_scores"] = dp.batch["token_level_rewards"] = dp.batch["rm_scores"]
    return compute_advantage(dp, adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)


@EXAMPLES
@given(plan=groups(), min_valid=st.integers(0, 3), norm=st.booleans())
def test_stock_grpo_with_the_fix_equals_the_reference(
    plan: list[list[tuple[bool, float]]], min_valid: int, norm: bool
) -> None:
    require_verl()
    from sessions.integrations.verl import to_data_proto
    from sessions.integrations.verl.grpo import ledger_grpo_advantage, zero_below_min_valid

    batch = ledger_batch(plan)
    reference = grpo_outcome_advantage(
        batch, exclude_placeholders=True, min_valid=min_valid, norm_by_std=norm
    )
    # the ledger batch path: to_data_proto isolates, verl's own GRPO, then the min_valid zeroing
    dp = stock_grpo(to_data_proto(batch), norm)
    zero_below_min_valid(dp, min_valid)
    assert torch.allclose(dp.batch["advantages"], reference, atol=1e-5), (plan, min_valid)
    # the rollout path: verl's DataProto as its agent loops built it
    rollout = ledger_grpo_advantage(
        verl_rollout_dp(batch), min_valid=min_valid, norm_adv_by_std_in_grpo=norm
    )
    assert torch.allclose(rollout.batch["advantages"], reference, atol=1e-5), (plan, min_valid)
    assert torch.equal(rollout.batch["returns"], rollout.batch["advantages"])


def test_without_the_fix_a_lone_survivor_gets_its_raw_score() -> None:
    require_verl()
    from sessions.integrations.verl import to_data_proto

    batch = ledger_batch([[(False, 1.0), (True, 0.0), (True, 0.0)], [(False, 1.0), (False, 0.0)]])
    dp = stock_grpo(to_data_proto(batch), True)
    reference = grpo_outcome_advantage(batch, exclude_placeholders=True, min_valid=2)
    assert dp.batch["advantages"][0].max() == pytest.approx(
        1.0, abs=1e-5
    )  # verl: score / (1 + eps)
    assert reference[0].abs().max() == 0.0  # the reference: no signal below min_valid


@pytest.fixture(scope="module")
def demo23(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The issue's held-out demo, recorded by the command line as a user runs it."""
    db = tmp_path_factory.mktemp("demo") / "demo23.db"
    args = "--steps 2 --prompts 16 --group-size 4 --fail-rate 0.3 --cancel-rate 0.1 --seed 23"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessions.cli",
            "demo",
            "--db",
            str(db),
            "--run",
            "d23",
            *args.split(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return f"sqlite+aiosqlite:///{db}", "d23"


def test_the_demo_steps_stock_path_equals_the_reference_at_min_valid(
    demo23: tuple[str, str],
) -> None:
    require_verl()
    from sessions import SyncLedger
    from sessions.integrations.verl import to_data_proto
    from sessions.integrations.verl.grpo import zero_below_min_valid

    url, run = demo23
    with SyncLedger.open(url, run=run) as ledger:
        batch = ledger.batch("train", 0, timeout=30)
        figures = ledger.metrics_dict("train", 0, timeout=30)
    reference = grpo_outcome_advantage(batch, exclude_placeholders=True, min_valid=2)
    dp = stock_grpo(to_data_proto(batch), True)
    stock = dp.batch["advantages"].clone()
    lone = (stock - reference).abs().amax(-1) > 1e-4
    assert int(lone.sum()) >= 1  # the lone survivors: stock GRPO gives them their score
    zero_below_min_valid(dp, 2)
    assert torch.allclose(dp.batch["advantages"], reference, atol=1e-5)
    assert figures["ledger/train/all/groups/below_min_valid"] >= 1


# ------------------------------------------------------------------------------ the hook
def hook_config(url: str, run: str, loss_agg_mode: str = "seq-mean-token-mean") -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "ledger": {"url": url, "run": run, "min_valid": 2},
            "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True},
            "actor_rollout_ref": {
                "actor": {"ppo_mini_batch_size": 4, "loss_agg_mode": loss_agg_mode},
                "rollout": {"n": 4, "prompt_length": 2048, "response_length": 4096},
            },
            "trainer": {"experiment_name": run},
        }
    )


def test_the_hook_fixes_advantages_weights_the_update_and_reports_the_ledger(
    demo23: tuple[str, str],
) -> None:
    require_verl()
    from sessions import SyncLedger
    from sessions.integrations.verl import to_data_proto
    from sessions.integrations.verl.trainer_hook import LedgerTrainerHook

    url, run = demo23
    with SyncLedger.open(url, run=run) as ledger:
        batch = ledger.batch("train", 0, timeout=30)
        hook = LedgerTrainerHook(hook_config(url, run), ledger=ledger)
        dp = stock_grpo(to_data_proto(batch, pad_to_multiple=16), True)
        reference = grpo_outcome_advantage(batch, exclude_placeholders=True, min_valid=2)
        with hook.actor_update(dp, dp_size=1) as weights:
            inside = dp.batch["advantages"].clone()
        size = int(batch.batch_size[0])
        assert torch.allclose(dp.batch["advantages"][:size], reference, atol=1e-5)
        assert torch.allclose(inside, dp.batch["advantages"] * weights.unsqueeze(-1))
        assert weights.max() > 1.0  # mini-batches with placeholders or filler weigh their rows up
        figures = hook.step_metrics("train", 0)
    assert figures and all(k.startswith("ledger/") for k in figures)
    assert figures["ledger/train/all/sessions/failed"] > 0


def test_the_trainer_calls_the_hook_around_verls_actor_update(
    demo23: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    require_verl()
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from sessions import SyncLedger
    from sessions.integrations.verl import to_data_proto
    from sessions.integrations.verl.trainer import LedgerRayPPOTrainer
    from sessions.integrations.verl.trainer_hook import LedgerTrainerHook

    url, run = demo23
    seen: dict[str, torch.Tensor] = {}

    def actor_workers(self: Any, batch: Any) -> Any:  # what the actor's GPUs would train on
        seen["advantages"] = batch.batch["advantages"].clone()
        return DataProto.from_single_dict(data={}, meta_info={"metrics": {"actor/pg_loss": 0.1}})

    monkeypatch.setattr(RayPPOTrainer, "_update_actor", actor_workers)
    monkeypatch.setattr(RayPPOTrainer, "_get_dp_size", lambda self, wg, role: 1)
    trainer = object.__new__(LedgerRayPPOTrainer)  # verl's __init__ builds Ray worker groups
    trainer.config, trainer.global_steps, trainer.actor_rollout_wg = hook_config(url, run), 0, None
    with SyncLedger.open(url, run=run) as ledger:
        trainer.__dict__["_ledger_hook"] = LedgerTrainerHook(trainer.config, ledger=ledger)
        dp = stock_grpo(
            to_data_proto(ledger.batch("train", 0, timeout=30), pad_to_multiple=16), True
        )
        output = trainer._update_actor(dp)
    assert not torch.equal(seen["advantages"], dp.batch["advantages"])  # weighted inside only
    assert output.meta_info["metrics"]["actor/pg_loss"] == 0.1
    assert any(k.startswith("ledger/train/") for k in output.meta_info["metrics"])
