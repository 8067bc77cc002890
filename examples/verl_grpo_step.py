"""One GRPO training step, verl-style, on sessions recorded through the ledger.

The glue-free path end to end, on CPU, in seconds: a tiny random-weight policy samples responses
for a few prompts x a group of 4; each rollout is recorded as a session (some fail, some are
cancelled), from plain synchronous code, as a verl V0 trainer loop is; the step's batch comes
back from the ledger and goes to verl's own functions with one documented call (`to_data_proto`):
verl's GRPO advantage, its vanilla PPO policy loss and `agg_loss`, its `compute_data_metrics`.
Then backward and an optimizer step. Failed sessions become masked placeholder rows, so their
gradients are exactly zero; the figures `ledger.metrics_dict` gives a tracker equal verl's own
`compute_data_metrics` on every name both report.

    pip install 'rollout-ledger[verl]'
    python examples/verl_grpo_step.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn
from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage, get_policy_loss_fn
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.reward import extract_reward
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from verl.workers.config import ActorConfig

from sessions import SyncLedger, to_data_proto

VOCAB, EOS = 32, 1
PROMPTS, GROUP, MAX_NEW_TOKENS = 4, 4, 8
STEP = 0
#: What happens to session (prompt, index): it succeeds unless named here.
FATES = {
    (1, 1): "tool_error",
    (2, 2): "timeout",
    (2, 3): "cancelled",
    (3, 0): "cancelled",
    (3, 1): "tool_error",
}


class TinyPolicy(nn.Module):
    """A bigram language model: the next token's logits from the current token (embedding + linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))  # [B, L, VOCAB]


@torch.no_grad()
def sample(policy: TinyPolicy, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Sample a response token by token; returns its tokens and their log-probs (the rollout's)."""
    response, logprobs, last = [], [], prompt[-1]
    for _ in range(MAX_NEW_TOKENS):
        dist = torch.distributions.Categorical(logits=policy(torch.tensor([last]))[0])
        token = dist.sample()
        response.append(int(token))
        logprobs.append(float(dist.log_prob(token)))
        last = int(token)
        if last == EOS:
            break
    return response, logprobs


def reward(response: list[int]) -> float:
    """The toy rule: the share of even tokens in the response."""
    return sum(token % 2 == 0 for token in response) / len(response)


def rollouts(ledger: SyncLedger, policy: TinyPolicy) -> None:
    """Every rollout a session; failures raise inside the block (failed + placeholder row),
    a cancelled one is cancelled (no row)."""
    generator = torch.Generator().manual_seed(1)
    for p in range(PROMPTS):
        uid = f"prompt{p}"
        prompt = torch.randint(2, VOCAB, (3 + p,), generator=generator).tolist()
        for index in range(GROUP):
            fate = FATES.get((p, index), "ok")
            try:
                with ledger.session(
                    f"{uid}-{index}",
                    uid=uid,
                    session_index=index,
                    group_size=GROUP,
                    partition="train",
                    global_step=STEP,
                    data_source="toy",
                ) as session:
                    response, logprobs = sample(policy, prompt)
                    session.record_trajectory(
                        prompt_ids=prompt, response_ids=response, response_logprobs=logprobs
                    )
                    if fate == "tool_error":
                        raise RuntimeError("the tool server crashed")
                    if fate == "timeout":
                        raise TimeoutError("the tool call timed out")
                    if fate == "cancelled":
                        session.cancel("preempted by the rollout engine")
                    else:
                        session.post_reward(reward(response))
            except (RuntimeError, TimeoutError) as error:
                print(f"  session {uid}-{index}: {session.state} ({type(error).__name__}: {error})")
            if fate == "cancelled":
                print(f"  session {uid}-{index}: {session.state}")


def log_probs(policy: TinyPolicy, data) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What verl's actor computes: the log-probs (and entropy) of each response token, from the
    logits at the positions before them (prompts left-padded, responses right-padded)."""
    responses = data.batch["responses"]
    logits_all = policy(data.batch["input_ids"])
    logits = logits_all[:, -responses.shape[-1] - 1 : -1]
    return logprobs_from_logits(logits, responses), entropy_from_logits(logits), logits_all


def main() -> None:
    torch.manual_seed(0)
    policy = TinyPolicy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    with (
        tempfile.TemporaryDirectory() as folder,
        SyncLedger.open(str(Path(folder) / "rollouts.db")) as ledger,
    ):
        print(f"recording {PROMPTS} prompts x {GROUP} sessions")
        rollouts(ledger, policy)
        batch = ledger.batch("train", STEP)
        tracked = ledger.metrics_dict(
            "train", STEP
        )  # what a tracker logs: verl's names, and ledger/...

    data = to_data_proto(batch)  # the one documented call: each placeholder its own uid
    rows, placeholders = len(data), data.batch["is_placeholder"]
    print(
        f"batch: {rows} rows ({int(placeholders.sum())} placeholders), response width {data.batch['responses'].shape[-1]}"
    )

    # verl's V0 step from here on (RayPPOTrainer.fit: reward, old log-probs, advantage, actor update)
    reward_tensor, _ = extract_reward(data)
    data.batch["token_level_scores"] = reward_tensor
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    with torch.no_grad():
        data.batch["old_log_probs"] = log_probs(policy, data)[0]
    mask = data.batch["response_mask"]
    trained = mask.bool()
    assert torch.allclose(
        data.batch["old_log_probs"][trained], data.batch["rollout_log_probs"][trained], atol=1e-5
    ), "the ledger returned the rollout's log-probs for the tokens sampled"
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=mask,
        index=data.non_tensor_batch["uid"],
    )
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    assert torch.equal(advantages[placeholders], torch.zeros_like(advantages[placeholders]))

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=GROUP,
        ppo_mini_batch_size=rows,
        ppo_micro_batch_size_per_gpu=rows,
        entropy_coeff=1e-3,
    )
    log_prob, entropy, logits = log_probs(policy, data)
    log_prob.retain_grad()
    logits.retain_grad()
    pg_loss, pg_metrics = get_policy_loss_fn("vanilla")(
        old_log_prob=data.batch["old_log_probs"],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
    )
    entropy_loss = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=config.loss_agg_mode)
    loss = pg_loss - config.entropy_coeff * entropy_loss
    optimizer.zero_grad()
    loss.backward()
    for name, grad in (("log-probs", log_prob.grad), ("logits", logits.grad)):
        assert torch.equal(grad[placeholders], torch.zeros_like(grad[placeholders])), (
            f"placeholder {name} gradient"
        )
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0))
    optimizer.step()

    verl_metrics = compute_data_metrics(batch=data, use_critic=False)
    print("ledger metrics (metrics_dict):")
    for name in (
        "sessions/total",
        "sessions/succeeded",
        "sessions/failed",
        "sessions/cancelled",
        "placeholders",
        "reward/mean",
        "reward/mean_success_only",
        "coverage",
    ):
        print(f"  ledger/train/all/{name} = {tracked[f'ledger/train/all/{name}']:.6f}")
    print("verl metrics (compute_data_metrics):")
    for name in (
        "critic/score/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "response/aborted_ratio",
        "num_turns/mean",
    ):
        print(f"  {name} = {float(verl_metrics[name]):.6f}")
    for name, value in pg_metrics.items():
        print(f"  {name} = {float(value):.6f}")
    shared = sorted(set(tracked) & set(verl_metrics))
    for name in shared:
        assert abs(float(verl_metrics[name]) - tracked[name]) < 1e-6, (
            name,
            float(verl_metrics[name]),
            tracked[name],
        )
    assert (
        abs(float(verl_metrics["critic/score/mean"]) - tracked["ledger/train/all/reward/mean"])
        < 1e-6
    )
    print(
        f"verl's compute_data_metrics equals the ledger's metrics_dict on all {len(shared)} names both report"
    )
    print("verl critic/score/mean equals the ledger's reward/mean")
    print(
        f"loss = {loss.item():.6f} (pg_loss {pg_loss.item():.6f}, entropy {entropy_loss.item():.6f}), "
        f"grad norm {grad_norm:.6f}"
    )
    print(f"placeholder rows: {int(placeholders.sum())}, their gradients are exactly 0")
    print("optimizer step done")


if __name__ == "__main__":
    main()
