"""TRL adapter (optional extra ``trl``): the ledger behind TRL's ``GRPOTrainer`` (``docs/trl.md``).

* ``LedgerRollout(runner, ledger, timeout=..., retry=...)`` (``rollout``): TRL's ``rollout_func``;
  each completion is a ledger session, a failed one a placeholder row TRL accepts (one token,
  ``env_mask`` 0, reward ``None``) instead of an exception that ends ``train()``.
* ``rollout.reward`` (``reward``): the companion reward function; it logs the ledger's figures
  (``ledger/train/all/reward/mean``, failures as zeros) beside TRL's success-only ``reward``.
* ``context.calls`` (``turns.ModelCalls``): a runner records each turn's generation as a model
  call as it happens, and may leave its row to them (the row the ledger assembles from them).
* ``LedgerGRPOTrainer`` (``trainer``): ``GRPOTrainer`` whose ``grpo``, ``sapo``, ``luspo`` and
  ``dr_grpo`` losses average over trainable rows only (``loss_types``).

Importing this package needs neither TRL nor transformers; ``LedgerGRPOTrainer`` imports TRL on
first use.
"""

from __future__ import annotations

# Public through `__all__`, which `lazy_names` builds with the lazy names below.
from sessions.integrations.trl.completion import FAILURE, REWARD, SESSION, Completion  # noqa: F401
from sessions.integrations.trl.errors import RunnerOutputError, TRLSetupError  # noqa: F401
from sessions.integrations.trl.identity import prompt_key  # noqa: F401
from sessions.integrations.trl.loss_types import ROW_MEAN_LOSS_TYPES, TOKEN_MEAN_LOSS_TYPES  # noqa: F401
from sessions.integrations.trl.reward import LedgerReward  # noqa: F401
from sessions.integrations.trl.rollout import Generation, LedgerRollout, RolloutContext  # noqa: F401
from sessions.integrations.trl.turns import STEP_VERSION, ModelCalls, sampled_logprobs  # noqa: F401
from sessions.lazy import lazy_names

#: TRL (and torch) load only when the trainer is asked for.
_LAZY = {"LedgerGRPOTrainer": "sessions.integrations.trl.trainer"}

__getattr__, __dir__, __all__ = lazy_names(
    globals(),
    _LAZY,
    eager=[
        "FAILURE",
        "REWARD",
        "ROW_MEAN_LOSS_TYPES",
        "SESSION",
        "STEP_VERSION",
        "TOKEN_MEAN_LOSS_TYPES",
        "Completion",
        "Generation",
        "LedgerReward",
        "LedgerRollout",
        "ModelCalls",
        "RolloutContext",
        "RunnerOutputError",
        "TRLSetupError",
        "prompt_key",
        "sampled_logprobs",
    ],
    extra="trl",
)
