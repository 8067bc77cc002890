"""``python -m sessions.integrations.verl.main_ppo trainer.use_v1=false ...``: verl's ``main_ppo``
with ``LedgerRayPPOTrainer`` in place of ``RayPPOTrainer`` (docs/design.md §13, docs/verl.md).

The same Hydra config and overrides as ``python -m verl.trainer.main_ppo``; this entry point is
the trainer side's one line. verl's V0 ``TaskRunner`` builds its trainer from the name
``RayPPOTrainer`` of its own module, so ``_LedgerTaskRunner`` points that name at the ledger's
subclass inside the task runner's own Ray process (the only process that builds the trainer)
before verl's ``run`` starts; everything else is verl's code as it is.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import hydra
import ray
from verl.trainer import main_ppo as verl_main_ppo
from verl.trainer import main_ppo_v0
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from sessions.errors import ConfigError

__all__ = ["main", "with_launch"]

_CONFIG_DIR = os.path.join(os.path.dirname(verl_main_ppo.__file__), "config")


class _LedgerTaskRunner(main_ppo_v0.TaskRunner.__ray_metadata__.modified_class):
    """verl's V0 task runner, building ``LedgerRayPPOTrainer``."""

    def run(self, config: Any) -> Any:
        from sessions.integrations.verl.trainer import LedgerRayPPOTrainer

        main_ppo_v0.RayPPOTrainer = LedgerRayPPOTrainer  # this process builds only this trainer
        return super().run(config)


@hydra.main(config_path=_CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    """verl's ``main`` (device, config checks, Ray), V0 with the ledger's trainer."""
    auto_set_device(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    if config.trainer.use_v1:
        raise ConfigError(
            "the ledger's trainer side is verl's V0 trainer: add trainer.use_v1=false (the rollout "
            "side, the ledger agent loop, works under V1 with verl's own main_ppo too)"
        )
    with_launch(config)
    verl_main_ppo.run_ppo(config, task_runner_class=ray.remote(_LedgerTaskRunner))


def with_launch(config: Any) -> None:
    """Name this start of the job in the config every Ray worker receives (``ledger.launch``),
    unless the command or ``ROLLOUT_LEDGER_LAUNCH`` names it: the workers of one job then agree
    on their launch, and a restarted job, resumed from its checkpoint, is a new one
    (docs/design.md §14)."""
    from omegaconf import open_dict

    if os.environ.get("ROLLOUT_LEDGER_LAUNCH"):
        return
    section = config.get("ledger")
    if section is not None and section.get("launch"):
        return
    launch = f"verl-{uuid.uuid4().hex[:16]}"
    with open_dict(config):
        if section is None:
            config.ledger = {"launch": launch}
        else:
            config.ledger.launch = launch


if __name__ == "__main__":
    main()
