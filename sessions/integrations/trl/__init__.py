"""TRL adapter (optional extra ``trl``): the ledger behind TRL's ``GRPOTrainer`` (``docs/trl.md``).

* ``LedgerRollout(runner, ledger, timeout=..., retry=...)`` (``rollout``): TRL's ``rollout_func``;
  each completion is a ledger session, a failed one a placeholder row TRL accepts (one token,
  ``env_mask`` 0, reward ``None``) instead of an exception that ends ``train()``.
* ``rollout.reward`` (``reward``): the companion reward function; it logs the ledger's figures
  (``ledger/train/all/reward/mean``, failures as zeros) beside TRL's success-only ``reward``.
* ``LedgerGRPOTrainer`` (``trainer``): ``GRPOTrainer`` whose ``grpo``, ``sapo``, ``luspo`` and
  ``dr_grpo`` losses average over trainable rows only (``loss_types``).

Importing this package needs neither TRL nor transformers; ``LedgerGRPOTrainer`` imports TRL on
first use.
"""

from __future__ import annotations

from typing import Any

from sessions.errors import MissingDependency
from sessions.integrations.trl.completion import FAILURE, REWARD, SESSION, Completion
from sessions.integrations.trl.errors import RunnerOutputError, TRLSetupError
from sessions.integrations.trl.identity import prompt_key
from sessions.integrations.trl.loss_types import ROW_MEAN_LOSS_TYPES, TOKEN_MEAN_LOSS_TYPES
from sessions.integrations.trl.reward import LedgerReward
from sessions.integrations.trl.rollout import Generation, LedgerRollout, RolloutContext

__all__ = [
    "FAILURE",
    "REWARD",
    "ROW_MEAN_LOSS_TYPES",
    "SESSION",
    "TOKEN_MEAN_LOSS_TYPES",
    "Completion",
    "Generation",
    "LedgerGRPOTrainer",
    "LedgerReward",
    "LedgerRollout",
    "RolloutContext",
    "RunnerOutputError",
    "TRLSetupError",
    "prompt_key",
]


def __getattr__(name: str) -> Any:
    if name == "LedgerGRPOTrainer":  # TRL (and torch) load only when the trainer is asked for
        try:
            from sessions.integrations.trl.trainer import LedgerGRPOTrainer
        except ImportError as error:
            raise MissingDependency(
                f"LedgerGRPOTrainer needs TRL ({error}); install the extra: pip install -e '.[trl]'"
            ) from error
        return LedgerGRPOTrainer
    raise AttributeError(f"module 'sessions.integrations.trl' has no attribute {name!r}")
