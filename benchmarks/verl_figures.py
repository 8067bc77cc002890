"""The figures docs/verl.md quotes: what each sessions.integrations.verl option changes in verl's
numbers, on recorded demo steps. Needs verl (``pip install -e '.[verl]'`` in a clone)::

    rollout-ledger demo --db demo.db --steps 2 --prompts 16 --group-size 4 \\
        --fail-rate 0.2 --cancel-rate 0.05 --seed 1 --run demo1
    python -m benchmarks.verl_figures --db demo.db --run demo1 --steps 0 1

Per train step: rows before/after padding to ``--multiple``; verl's GRPO group baselines (the
per-group mean ``compute_grpo_outcome_advantage`` subtracts, read back from its advantages with
std normalisation off), averaged over the groups that have a trainable row, with and without
placeholder isolation, and the per-group shift; the loss scale of each ``loss_agg_mode`` in
verl's worker loss (``ppo_loss``, one mini-batch of the whole step, dp 1): loss over the step
divided by the loss over its trainable rows, without and with ``unbiased_seq_mean``; verl's
``critic/score/mean`` beside the ledger's ``reward/mean``, with and without the filler rows.
Per val step: every ``val-core`` figure of verl's own ``_val_metrics_update`` beside
``Ledger.metrics_dict``'s, and the ledger's ``reward/mean_per_uid`` / ``reward/uids_excluded``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import torch

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def group_baselines(dp: Any) -> dict[str, float]:
    """group_uid -> the mean verl's GRPO subtracts from that group's trainable rows."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = dp.batch["rm_scores"].sum(-1)
    advantages, _ = compute_grpo_outcome_advantage(
        dp.batch["rm_scores"],
        dp.batch["response_mask"],
        dp.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=False,
    )
    mask = dp.batch["response_mask"]
    out: dict[str, float] = {}
    for i, group in enumerate(dp.non_tensor_batch["group_uid"].tolist()):
        if mask[i].sum() > 0 and not bool(dp.batch["is_padding"][i]):
            first = int(mask[i].argmax())
            out[group] = float(scores[i] - advantages[i, first])
    return out


def worker_loss(
    dp: Any, log_probs: torch.Tensor, mode: str, rows: torch.Tensor, global_batch_size: int | None
) -> float:
    """verl's ppo_loss over ``rows`` as one mini-batch on one rank."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=mode,
        use_torch_compile=False,
    )
    td = left_right_2_no_padding(dp.select_idxs(rows).to_tensordict())
    tu.assign_non_tensor(
        td,
        dp_size=1,
        batch_num_tokens=int(dp.batch["response_mask"][rows].sum()),
        global_batch_size=global_batch_size,
    )
    values = log_probs[rows][dp.batch["attention_mask"][rows].bool()]
    loss, _ = ppo_loss(config, {"log_probs": values}, td)
    return float(loss)


def loss_scales(dp: Any) -> dict[str, tuple[float, float]]:
    """mode -> (loss / loss over trainable rows) without and with the fix; one mini-batch of all rows."""
    from sessions.integrations.verl import unbiased_seq_mean

    generator = torch.Generator().manual_seed(0)
    dp.batch["old_log_probs"] = dp.batch["rollout_log_probs"] - 0.1 * torch.rand(
        dp.batch["rollout_log_probs"].shape, generator=generator
    )
    log_probs = -torch.rand(dp.batch["attention_mask"].shape, generator=generator)
    every = torch.arange(len(dp))
    trainable = every[dp.batch["response_mask"].sum(-1) > 0]
    out = {}
    for mode in MODES:
        real = worker_loss(dp, log_probs, mode, trainable, None)
        plain = worker_loss(dp, log_probs, mode, every, len(dp))
        with unbiased_seq_mean(dp, loss_agg_mode=mode, mini_batch_size=len(dp)):
            fixed = worker_loss(dp, log_probs, mode, every, len(dp))
        out[mode] = (plain / real, fixed / real)
    return out


def grpo(dp: Any) -> Any:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    dp.batch["token_level_scores"] = dp.batch["token_level_rewards"] = dp.batch["rm_scores"]
    dp.batch["advantages"], dp.batch["returns"] = compute_grpo_outcome_advantage(
        dp.batch["rm_scores"], dp.batch["response_mask"], dp.non_tensor_batch["uid"]
    )
    return dp


def reference_gap(batch: Any, min_valid: int) -> None:
    """verl's stock GRPO advantages beside the ledger's reference
    (`grpo_outcome_advantage(..., exclude_placeholders=True, min_valid=...)`): stock, with the
    placeholders isolated, and with the groups below `min_valid` zeroed as the trainer side does."""
    from sessions.batches.advantage import grpo_outcome_advantage
    from sessions.integrations.verl import to_data_proto
    from sessions.integrations.verl.grpo import zero_below_min_valid

    reference = grpo_outcome_advantage(batch, exclude_placeholders=True, min_valid=min_valid)
    stock = grpo(to_data_proto(batch, isolate_placeholders=False)).batch["advantages"]
    isolated = grpo(to_data_proto(batch, isolate_placeholders=True))
    alone = isolated.batch["advantages"].clone()
    zero_below_min_valid(isolated, min_valid)
    for label, advantages in (
        ("stock", stock),
        ("placeholders isolated", alone),
        (f"isolated + groups below min_valid={min_valid} zeroed", isolated.batch["advantages"]),
    ):
        gap = (advantages - reference).abs().amax(-1)
        print(
            f"GRPO vs the reference at min_valid={min_valid}, {label}: "
            f"{int((gap > 1e-4).sum())} rows differ, max |delta| {float(gap.max()):.2g}"
        )


async def figures(db: str, run: str, steps: list[int], multiple: int, min_valid: int) -> None:
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    from sessions import Ledger
    from sessions.integrations.verl import to_data_proto, without_padding

    async with Ledger.open(db, run=run, migrate=False) as ledger:
        for step in steps:
            batch = await ledger.batch("train", step)
            metrics = {
                m.metric: m.value
                for m in await ledger.metrics("train", step)
                if m.data_source is None
            }
            size = batch.batch_size[0]
            placeholders = int(batch["is_placeholder"].sum())
            print(
                f"## train step {step}: {size} rows ({placeholders} placeholders), padded to {multiple}: "
                f"{len(to_data_proto(batch, pad_to_multiple=multiple))} rows"
            )
            stock = group_baselines(to_data_proto(batch, isolate_placeholders=False))
            isolated = group_baselines(to_data_proto(batch, isolate_placeholders=True))
            shift = [isolated[g] - stock[g] for g in stock]
            moved = sum(1 for s in shift if abs(s) > 1e-9)
            print(
                f"GRPO baseline, mean over {len(stock)} groups with a trainable row: stock {sum(stock.values()) / len(stock):.4f}, "
                f"isolated {sum(isolated.values()) / len(isolated):.4f}; shift (isolated - stock) mean {sum(shift) / len(shift):.4f}, "
                f"min {min(shift):.4f}, max {max(shift):.4f}, groups moved {moved}"
            )
            reference_gap(batch, min_valid)
            padded = grpo(to_data_proto(batch, pad_to_multiple=multiple))
            trainable = int((padded.batch["response_mask"].sum(-1) > 0).sum())
            print(
                f"trainable rows {trainable} of {len(padded)} (mini-batch of {len(padded)}); loss scale (loss / loss over trainable rows):"
            )
            for mode, (plain, fixed) in loss_scales(padded).items():
                print(f"  {mode:24s} stock {plain:.4f}   with unbiased_seq_mean {fixed:.4f}")
            unpadded = grpo(to_data_proto(batch))
            for mode, (plain, fixed) in loss_scales(unpadded).items():
                if mode != "token-mean":
                    print(
                        f"  unpadded ({size} rows) {mode:24s} stock {plain:.4f}   fixed {fixed:.4f}"
                    )
            counted = compute_data_metrics(padded, use_critic=False)
            honest = compute_data_metrics(without_padding(padded), use_critic=False)
            print(
                f"critic/score/mean: verl on the padded batch {counted['critic/score/mean']:.4f}, after without_padding "
                f"{honest['critic/score/mean']:.4f}; ledger reward/mean {metrics['reward/mean']:.4f}"
            )
            print(
                f"num_turns/mean {honest['num_turns/mean']:.4f}, response_length/mean {honest['response_length/mean']:.4f}"
            )
            print()
            await validation_figures(ledger, step)


async def validation_figures(ledger: Any, step: int) -> None:
    """verl's own validation dict (`RayPPOTrainer._val_metrics_update` on the val batch, as V0's
    `_validate` feeds it) beside `Ledger.metrics_dict`: every val-core figure, and the largest
    difference over all of verl's keys."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from sessions.batches import non_tensor

    batch = await ledger.batch("val", step)
    mine = await ledger.metrics_dict("val", step)
    verl = RayPPOTrainer._val_metrics_update(  # uses nothing of self
        None,
        np.array(non_tensor(batch, "data_source"), dtype=object),
        non_tensor(batch, "uid"),
        {"reward": batch["rm_scores"].sum(-1).tolist()},
        [np.array(non_tensor(batch, "__num_turns__"))],
    )
    missing = sorted(set(verl) - set(mine))
    worst = max(abs(float(verl[k]) - mine[k]) for k in verl if k in mine)
    print(
        f"## val step {step}: {len(verl)} figures from verl, missing from metrics_dict: {missing or 'none'}; "
        f"largest |verl - ledger| {worst:.1e}"
    )
    for key in sorted(k for k in verl if k.startswith("val-core/")):
        print(f"  {key:40s} verl {float(verl[key]):.6f}   ledger {mine[key]:.6f}")
    by_source = {
        m.data_source: m
        for m in await ledger.metrics("val", step)
        if m.metric == "reward/mean_per_uid"
    }
    excluded = {
        m.data_source: m.value
        for m in await ledger.metrics("val", step)
        if m.metric == "reward/uids_excluded"
    }
    for source, row in sorted(by_source.items(), key=lambda kv: str(kv[0])):
        print(
            f"  ledger {source or 'all'}: reward/mean_per_uid {row.value:.6f}, reward/uids_excluded {excluded.get(source, 0):.0f}"
        )
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.verl_figures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--db", required=True, help="database URL or SQLite file the demo recorded into"
    )
    parser.add_argument(
        "--run", required=True, help="the demo's run name (--run of rollout-ledger demo)"
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--multiple", type=int, default=64, help="pad_to_multiple (verl's batch multiple)"
    )
    parser.add_argument("--min-valid", type=int, default=2, help="the run's min_valid")
    args = parser.parse_args(argv)
    asyncio.run(figures(args.db, args.run, args.steps, args.multiple, args.min_valid))


if __name__ == "__main__":
    main()
