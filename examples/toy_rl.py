"""The toy world `train_grpo.py` trains in: a verifiable task, a small policy, a batching
sampler that plays the inference server, and the faults agent runs meet.

Nothing here knows the ledger: it is what a user's own trainer would already have. Everything
is seeded, and what a session meets (its sample, its fault) is drawn from its own key, never
from the order the event loop happens to run sessions in, so a run repeats under its seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------------ the task
PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGIT0 = 4  # token of digit 0; digits 0-9 are tokens 4-13
VOCAB = DIGIT0 + 10
LEVELS = (1, 2, 3, 4)  # a prompt of level k holds k digits
MAX_PROMPT = 2 + max(LEVELS)  # BOS, the digits, SEP
MAX_NEW_TOKENS = 4
DATA_SOURCE = "maxdigit"


@dataclass(frozen=True)
class Problem:
    """One prompt: the largest of `level` digits. `uid` names it in the ledger (no `_`)."""

    uid: str
    level: int
    digits: tuple[int, ...]

    @property
    def prompt_ids(self) -> list[int]:
        return [BOS, *(DIGIT0 + d for d in self.digits), SEP]

    @property
    def answer(self) -> int:
        return DIGIT0 + max(self.digits)

    def reward(self, response_ids: Sequence[int]) -> float:
        """Exact match of the final answer: the last digit written before EOS (1.0 or 0.0)."""
        body = list(response_ids)
        if EOS in body:
            body = body[: body.index(EOS)]
        digits = [t for t in body if t >= DIGIT0]
        return float(bool(digits) and digits[-1] == self.answer)


def problems(rng: random.Random, count: int, prefix: str) -> list[Problem]:
    """`count` problems, levels in turn (so every level is equally present). The answer is
    uniform over the digits at every level and the others are drawn below it, so guessing a high
    digit pays nothing: a level-k prompt asks for k - 1 comparisons, and more is harder."""
    out = []
    for i in range(count):
        level = LEVELS[i % len(LEVELS)]
        top = rng.randrange(10)
        digits = [top, *(rng.randint(0, top) for _ in range(level - 1))]
        rng.shuffle(digits)
        out.append(Problem(f"{prefix}-{i}", level, tuple(digits)))
    return out


# ------------------------------------------------------------------------------ the policy
class Block(nn.Module):
    """Pre-norm self-attention and MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, width = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, length, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(b, length, width))
        return x + self.mlp(self.norm2(x))


class Policy(nn.Module):
    """A small causal transformer over the task's 14 tokens (about 0.1M parameters at width 64).

    Takes verl's layout as it is: left-padded prompts, right-padded responses, `attention_mask`
    1 on real tokens; positions count real tokens only, so a row's logits do not depend on how
    much padding its batch needed.
    """

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(MAX_PROMPT + MAX_NEW_TOKENS, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        # every query sees itself, so a padding row never attends to nothing (no NaN)
        mask = (causal & attention_mask.bool()[:, None, :]) | torch.eye(length, dtype=torch.bool)
        x = self.token(input_ids) + self.position(positions)
        for block in self.blocks:
            x = block(x, mask[:, None])
        return self.head(self.norm(x))  # [B, L, VOCAB]


def response_logits(policy: Policy, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What verl's actor computes from: the logits at the positions before each response token."""
    width = batch["responses"].shape[-1]
    return policy(batch["input_ids"], batch["attention_mask"])[:, -width - 1 : -1]


# ------------------------------------------------------------------------------ the sampler
class Sampler:
    """The inference server: agents `await generate(...)`; requests that arrive together are
    sampled in one batch. Each request brings its own seed, and its Gumbel noise is drawn from
    it, so a response does not depend on which requests shared its batch."""

    def __init__(
        self,
        policy: Policy,
        timer: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.policy = policy
        self.timer = timer  # entered around each batch's compute (the example's clock)
        self.batches = 0
        self._pending: list[
            tuple[list[int], int, asyncio.Future[tuple[list[int], list[float]]]]
        ] = []
        self._flushing = False

    async def generate(self, prompt_ids: list[int], seed: int) -> tuple[list[int], list[float]]:
        """A response (ending at EOS or after MAX_NEW_TOKENS) and its tokens' log-probs."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, seed, future))
        if not self._flushing:
            self._flushing = True
            asyncio.ensure_future(self._flush_when_quiet())
        return await future

    async def _flush_when_quiet(self) -> None:
        seen = -1
        while len(self._pending) != seen:  # until a turn of the loop brings no new request
            seen = len(self._pending)
            await asyncio.sleep(0)
        batch, self._pending, self._flushing = self._pending, [], False
        try:
            with self.timer():
                results = self.sample([p for p, _, _ in batch], [s for _, s, _ in batch])
        except Exception as error:  # noqa: BLE001 - every waiting agent learns of it
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, _, future), result in zip(batch, results):
            if not future.done():  # an agent cancelled meanwhile no longer waits
                future.set_result(result)

    @torch.no_grad()
    def sample(
        self, prompts: list[list[int]], seeds: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        self.batches += 1
        rows, width = len(prompts), max(map(len, prompts))
        ids = torch.full((rows, width), PAD)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        uniform = torch.stack(
            [
                torch.rand(MAX_NEW_TOKENS, VOCAB, generator=torch.Generator().manual_seed(seed))
                for seed in seeds
            ]
        )
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-10, 1 - 1e-7)))
        done = torch.zeros(rows, dtype=torch.bool)
        tokens, logprobs = [], []
        for t in range(MAX_NEW_TOKENS):
            logp = torch.log_softmax(self.policy(ids, mask)[:, -1], dim=-1)
            token = (logp + gumbel[:, t]).argmax(-1)  # a sample of softmax(logits), temperature 1
            tokens.append(torch.where(done, PAD, token))
            logprobs.append(logp.gather(-1, token[:, None])[:, 0])
            ids = torch.cat([ids, tokens[-1][:, None]], dim=1)
            mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
            done |= token == EOS
        out = []
        for row_tokens, row_logprobs in zip(
            torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
        ):
            end = row_tokens.index(EOS) + 1 if EOS in row_tokens else MAX_NEW_TOKENS
            out.append((row_tokens[:end], row_logprobs[:end]))
        return out


# ------------------------------------------------------------------------------ the faults
FAULTS = ("runner_error", "timeout", "sandbox_error")
#: How a failing attempt fails: sandbox crashes (infra, retried), tool calls that hang past
#: their timeout, agent code that raises (both the policy's to answer for).
FAULT_SHARES = {"sandbox_error": 0.4, "timeout": 0.35, "runner_error": 0.25}
#: Harder prompts fail more, as long tool runs do; the mean weight over the levels is 1.
LEVEL_WEIGHT = {1: 0.25, 2: 0.75, 3: 1.25, 4: 1.75}


@dataclass(frozen=True)
class Faults:
    """What an attempt meets: `ok`, a fault of FAULTS, or `preempted` (the rollout engine
    cancels the session). `fail_rate` is the failure rate at the mean level; `cancel_rate` is
    the same for every prompt."""

    fail_rate: float = 0.2
    cancel_rate: float = 0.02
    seed: int = 0

    def fate(self, key: str, attempt: int, level: int) -> str:
        draw = random.Random(f"{self.seed}:{key}:{attempt}").random()
        failing = min(1.0, self.fail_rate * LEVEL_WEIGHT[level])
        edge = 0.0
        for fault in FAULTS:
            edge += failing * FAULT_SHARES[fault]
            if draw < edge:
                return fault
        if attempt == 1 and draw < edge + self.cancel_rate:
            return "preempted"
        return "ok"

    def noise_seed(self, key: str, attempt: int) -> int:
        return random.Random(f"{self.seed}:sample:{key}:{attempt}").getrandbits(62)
