"""What a step's failures cost (docs/failures.md "What failures cost"): figures `metrics_dict`
adds under `ledger/<partition>/all/cost/`.

* `masked_share` and `masked_share/<reason>`: the share of the step's batch rows that are
  placeholders (response mask 0), all together and by failure reason;
* `reward_gap`: `reward/mean_success_only - reward/mean`, what dropping failures would have
  inflated the headline by (NeMo-Gym: "the score a run lost to its own infrastructure");
* `groups_all_failed`: groups with no successful session;
* `rows_no_signal`: successful rows of groups with fewer than `min_valid` successes, whose GRPO
  advantage is 0 (miles: dropping a group for one failure wastes 1 - (1 - p)^n of rollouts);
* `groups_unusable/<budget>`, `rows_unusable/<budget>`: groups left below `min_valid` with a
  session whose retry a spent budget refused (`RetryPolicy.group_budget` / `step_budget`), and
  their rows: GRPO gives them no signal, as `min_valid` says, and this is why;
* `wasted_tokens/<cause>/<reason>` and `wasted_tokens`: model-call response tokens that trained
  nothing, where calls are recorded: of attempts `retried` or `failed`, by reason, and of
  successful sessions in groups that gave `no_signal`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sessions.projection.verl_metrics import LEDGER_PREFIX
from sessions.vocabulary import ALL_SOURCES
from store import AsyncEngine
from store import read_models as rm

__all__ = ["cost_metrics", "step_cost_metrics"]


def cost_metrics(
    partition: str,
    rows: Sequence[Mapping[str, Any]],
    counts: Mapping[str, float],
    wasted: Iterable[tuple[str, str, int]],
    min_valid: int,
    refused: Mapping[str, str] | None = None,
    group_min_valid: Mapping[str, int | None] | None = None,
) -> dict[str, float]:
    """The step's cost figures from its batch rows (queue rows of kind `row`), its all-sources
    metric counts by name, its wasted call tokens as (cause, reason, tokens), its sessions
    whose retry a budget refused (session id -> budget), and each group's recorded `min_valid`
    (uid -> value, None or absent: `min_valid`)."""
    prefix = f"{LEDGER_PREFIX}/{partition}/{ALL_SOURCES}/cost"
    batch = [r for r in rows if r.get("kind", "row") == "row"]
    out: dict[str, float] = {}
    masked = [r for r in batch if r.get("is_placeholder")]
    if batch:
        out[f"{prefix}/masked_share"] = len(masked) / len(batch)
        for reason, n in sorted(Counter(str(r.get("failure_reason")) for r in masked).items()):
            out[f"{prefix}/masked_share/{reason}"] = n / len(batch)
    honest, inflated = counts.get("reward/mean"), counts.get("reward/mean_success_only")
    if honest is not None and inflated is not None:
        out[f"{prefix}/reward_gap"] = inflated - honest
    out[f"{prefix}/groups_all_failed"] = float(counts.get("groups/failure", 0.0))
    valid: Counter[str] = Counter(str(r["uid"]) for r in batch if not r.get("is_placeholder"))

    def below(uid: str) -> bool:
        bound = (group_min_valid or {}).get(uid)
        return valid.get(uid, 0) < (min_valid if bound is None else bound)

    out[f"{prefix}/rows_no_signal"] = float(sum(n for uid, n in valid.items() if below(uid)))
    by_uid: dict[str, list[Mapping[str, Any]]] = {}
    for row in batch:
        by_uid.setdefault(str(row["uid"]), []).append(row)
    for uid, members in sorted(by_uid.items()):
        budgets = {(refused or {}).get(str(r.get("session_id"))) for r in members} - {None}
        if not below(uid):
            continue
        for budget in sorted(b for b in budgets if b):
            for name, amount in (("groups_unusable", 1.0), ("rows_unusable", float(len(members)))):
                key = f"{prefix}/{name}/{budget}"
                out[key] = out.get(key, 0.0) + amount
    total = 0
    for cause, reason, tokens in wasted:
        out[f"{prefix}/wasted_tokens/{cause}/{reason}"] = float(tokens)
        total += tokens
    out[f"{prefix}/wasted_tokens"] = float(total)
    return out


async def step_cost_metrics(
    engine: AsyncEngine,
    run: str,
    partition: str,
    global_step: int | None,
    rows: Sequence[Mapping[str, Any]],
    counts: Mapping[str, float],
    min_valid: int,
) -> dict[str, float]:
    """`cost_metrics` of a settled step, its wasted call tokens and refused retries read from
    the log's views (`min_valid`: a group's where it records none)."""
    async with engine.connect() as conn:
        wasted = [
            (cause, reason, tokens)
            for _p, _s, cause, reason, tokens in await rm.wasted_call_tokens(
                conn, run, partition, global_step, default_min_valid=min_valid
            )
        ]
        refused = await rm.refused_retries(conn, run, partition, global_step)
        bounds = await rm.group_min_valid(conn, run, partition, global_step)
    return cost_metrics(partition, rows, counts, wasted, min_valid, refused, bounds)
