"""``python -m sessions.integrations.verl.main_ppo +ledger.url=... ...``: verl's ``main_ppo``
with ``LedgerRayPPOTrainer`` in place of ``RayPPOTrainer`` (docs/design.md §13, docs/verl.md).
It runs verl's V0 trainer and the ledger's agent loops unless the command names others
(``apply_ledger_defaults``), so the module swap and ``+ledger.url`` are the whole setup.

The same Hydra config and overrides as ``python -m verl.trainer.main_ppo``; this entry point is
the trainer side's one line. verl's V0 ``TaskRunner`` builds its trainer from the name
``RayPPOTrainer`` of its own module, so ``_LedgerTaskRunner`` points that name at the ledger's
subclass inside the task runner's own Ray process (the only process that builds the trainer)
before verl's ``run`` starts; everything else is verl's code as it is. The agent-loop YAML's inner
loops, the ledger's settings and its database are checked first (``check_agent_loops``,
``check_ledger``), before Ray starts: a misconfiguration is one error at the job's first line.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any

import hydra
import ray
from verl.trainer import main_ppo as verl_main_ppo
from verl.trainer import main_ppo_v0
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from sessions.errors import ConfigError
from sessions.integrations.ledger_check import check_ledger_sync
from sessions.integrations.verl.agent_loop.settings import URL_SETTING, LedgerSettings

__all__ = ["apply_ledger_defaults", "check_agent_loops", "check_ledger", "main", "with_launch"]

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
    from hydra.core.hydra_config import HydraConfig

    apply_ledger_defaults(config, HydraConfig.get().overrides.task)
    if not check_agent_loops(config):
        raise ConfigError(
            "the agent-loop YAML (actor_rollout_ref.rollout.agent.agent_loop_config_path) has no "
            "ledger entry, so no run would be recorded and the trainer would wait for steps that "
            "never settle; copy the entries of `python -m sessions.integrations.verl.agent_loop`'s "
            "file beside your own"
        )
    # Named before the check, which then records the launch and fails the dead one's orphans.
    with_launch(config)
    check_ledger(config)
    auto_set_device(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    verl_main_ppo.run_ppo(config, task_runner_class=ray.remote(_LedgerTaskRunner))


def apply_ledger_defaults(config: Any, overrides: Sequence[str]) -> None:
    """What this entry point implies, unless the command line says otherwise: verl's V0 trainer
    (``trainer.use_v1=false``; verl 0.9.1 defaults to V1, and the ledger's trainer is V0's) and
    the ledger's agent loops (``agent_loop_config_path``: the trainer side reads the steps the
    rollout side records). ``trainer.use_v1=true`` given explicitly is refused."""
    from omegaconf import open_dict

    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG

    given = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    with open_dict(config):
        if "trainer.use_v1" not in given:
            config.trainer.use_v1 = False
        elif config.trainer.use_v1:
            raise ConfigError(
                "trainer.use_v1=true: the ledger's trainer side is verl's V0 trainer; drop the "
                "override (this entry point runs V0), or run V1 with verl's own main_ppo and the "
                "ledger's agent loops (docs/verl.md)"
            )
        agent = config.actor_rollout_ref.rollout.agent
        if not agent.get("agent_loop_config_path"):
            agent.agent_loop_config_path = AGENT_LOOP_CONFIG


def check_agent_loops(config: Any) -> int:
    """The agent-loop YAML (``agent_loop_config_path``) read as verl's workers will read it, and
    every ledger entry's inner loop imported, before Ray starts (each worker builds it again).
    Returns how many ledger entries were checked (0 without a YAML)."""
    from omegaconf import OmegaConf
    from verl.utils.import_utils import resolve_config_path

    from sessions.integrations.verl.agent_loop.loop import check_agent_loop_entries

    path = config.actor_rollout_ref.rollout.agent.get("agent_loop_config_path")
    if not path:
        return 0
    try:
        entries = OmegaConf.load(resolve_config_path(path))
    except Exception as error:  # noqa: BLE001 - named here, before any worker reads it
        raise ConfigError(
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path!r} cannot be read "
            f"({type(error).__name__}: {error}); give the path that "
            "`python -m sessions.integrations.verl.agent_loop` prints, or your own YAML"
        ) from error
    return check_agent_loop_entries(list(entries))


def check_ledger(config: Any) -> LedgerSettings:
    """The ``ledger`` section read and its database opened (driver, reachability, schema) before
    Ray starts: a wrong ``+ledger.url`` is one error at the job's first line, not at the first
    actor update after a whole rollout."""
    settings = LedgerSettings.from_config(config)
    check_ledger_sync(settings.url, setting=URL_SETTING, **settings.ledger_options())
    return settings


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
