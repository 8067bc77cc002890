"""The companion reward function, and the ledger's figures in TRL's log beside its own `reward`.

TRL scores rows only through reward functions, and hands each one `log_metric`, whose values it
averages over ranks and logs with its own at the step. `LedgerReward` returns each row's reward
as the runner reported it and `None` for a failed session's placeholder, so TRL's group baseline
and its logged `reward` leave the placeholder out; that `reward` is therefore the success-only
mean, and the ledger's honest `ledger/train/all/reward/mean` (failures as zeros) is logged beside
it, with every other figure of the step's `metrics_dict` under the ledger's names.

A train step is one generation, so its figures are logged by that generation's reward call. An
evaluation is many generations at one step (one per eval batch, and TRL averages their values):
its figures are logged once, when it ends, by a callback, as `eval_ledger/val/...`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from sessions import SyncLedger
from sessions.integrations.trl.completion import FAILURE, REWARD
from sessions.integrations.trl.errors import TRLSetupError

__all__ = [
    "LEDGER_PREFIX",
    "LedgerReward",
    "eval_figures_callback",
    "ledger_figures",
]


class _ScoredCall(Protocol):
    """The `rollout_func` call TRL is scoring: its partition and step (`rollout.Generation`)."""

    @property
    def partition(self) -> str: ...

    @property
    def global_step(self) -> int: ...


class _ScoredRollout(Protocol):
    """What the reward function and the evaluation's callback read of their rollout
    (`rollout.LedgerRollout` is one): the latest call, the val steps recorded, a step's figures.
    A protocol, so this module needs nothing of `rollout.py`, which builds on it."""

    @property
    def last(self) -> _ScoredCall | None: ...

    @property
    def val_steps(self) -> Collection[int]: ...

    def figures(self, partition: str, global_step: int) -> dict[str, float]: ...


#: The ledger's own figures in `metrics_dict` (the rest are verl's names).
LEDGER_PREFIX = "ledger/"


def ledger_figures(
    ledger: SyncLedger, partition: str, global_step: int, *, timeout: float | None
) -> dict[str, float]:
    """The ledger's figures of a step, once every group of it is settled (on every rank alike)."""
    figures = ledger.metrics_dict(partition, global_step, timeout=timeout)
    return {name: value for name, value in figures.items() if name.startswith(LEDGER_PREFIX)}


class LedgerReward:
    """A TRL reward function (column `ledger`): the runners' rewards, `None` for failed sessions;
    logs the ledger's figures of each train step through `log_metric`."""

    #: TRL names a reward function's columns after it (`rewards/ledger/mean`).
    __name__ = "ledger"

    def __init__(self, rollout: _ScoredRollout) -> None:
        self._rollout = rollout

    def __call__(
        self,
        prompts: Any = None,
        completions: Any = None,
        log_metric: Any = None,
        log_extra: Any = None,
        **columns: Any,
    ) -> list[float | None]:
        rewards = columns.get(REWARD)
        generation = self._rollout.last
        if rewards is None or generation is None:
            raise TRLSetupError(
                "the ledger's reward function got no ledger_reward column: pass its own LedgerRollout as the "
                "trainer's rollout_func (GRPOTrainer(rollout_func=rollout, reward_funcs=rollout.reward))"
            )
        if log_extra is not None:  # TRL's completions table: why a row is a placeholder
            log_extra(FAILURE, [reason or "" for reason in columns.get(FAILURE, [])])
        if generation.partition == "train" and log_metric is not None:
            for name, value in self._rollout.figures("train", generation.global_step).items():
                log_metric(name, value)
        return list(rewards)


def eval_figures_callback(rollout: _ScoredRollout, trainer: Any) -> Any:
    """A `TrainerCallback` that, when an evaluation ends, adds the ledger's figures of its val step
    to the evaluation's metrics (what `trainer.evaluate()` returns) and logs them."""
    from transformers import TrainerCallback

    class LedgerEvalFigures(TrainerCallback):  # type: ignore[misc]
        def on_evaluate(
            self, args: Any, state: Any, control: Any, metrics: Any = None, **_: Any
        ) -> None:
            step = int(state.global_step)
            if step not in rollout.val_steps:
                return  # this evaluation recorded nothing through the ledger
            prefix = next(
                (k[: -len("_runtime")] for k in (metrics or {}) if k.endswith("_runtime")), "eval"
            )
            figures = {f"{prefix}_{k}": v for k, v in rollout.figures("val", step).items()}
            if metrics is not None:
                metrics.update(figures)
            trainer.log(figures)

    return LedgerEvalFigures()
