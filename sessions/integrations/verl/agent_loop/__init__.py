"""The rollout side of verl: every agent-loop run a ledger session, a failure a placeholder row.

One line in a verl command turns it on (docs/verl.md), plus the ledger's database::

    actor_rollout_ref.rollout.agent.agent_loop_config_path=$(python -m sessions.integrations.verl.agent_loop)
    +ledger.url=postgresql://host/rollouts

The YAML file (``AGENT_LOOP_CONFIG``) registers ``LedgerSingleTurnAgentLoop`` and
``LedgerToolAgentLoop`` under verl's own names ``single_turn_agent`` and ``tool_agent``; verl's
Ray workers read it themselves (``@register`` in the driver never reaches them). A loop of your
own: an entry with ``_target_: sessions.integrations.verl.agent_loop.LedgerAgentLoop`` and
``inner_agent:`` its name or class path.

Modules: ``loop`` (the agent loop), ``sample`` (a run's group slot from verl's fields),
``placeholder_output`` (the failed run's ``AgentLoopOutput`` in the batch's schema),
``process_ledger`` (one ``Ledger`` per worker process), ``settings`` (the ``ledger`` config
section). The loop classes import verl when first used; the rest needs only the ledger.
"""

from __future__ import annotations

from pathlib import Path

# Public through `__all__`, which `lazy_names` builds with the lazy names below.
from sessions.integrations.verl.agent_loop.process_ledger import (  # noqa: F401
    close_process_ledgers,
    process_ledger,
)
from sessions.integrations.verl.agent_loop.settings import CONFIG_SECTION, LedgerSettings  # noqa: F401
from sessions.lazy import lazy_names

#: The agent-loop config file to give verl (``agent.agent_loop_config_path``).
AGENT_LOOP_CONFIG = str(Path(__file__).with_name("agent_loops.yaml"))

_LAZY = {
    "LedgerAgentLoop": "sessions.integrations.verl.agent_loop.loop",
    "LedgerSingleTurnAgentLoop": "sessions.integrations.verl.agent_loop.loop",
    "LedgerToolAgentLoop": "sessions.integrations.verl.agent_loop.loop",
    "session_id_for": "sessions.integrations.verl.agent_loop.loop",
    "FAILURE_REASON": "sessions.integrations.verl.agent_loop.placeholder_output",
    "IS_PLACEHOLDER": "sessions.integrations.verl.agent_loop.placeholder_output",
}


__getattr__, __dir__, __all__ = lazy_names(
    globals(),
    _LAZY,
    eager=[
        "AGENT_LOOP_CONFIG",
        "CONFIG_SECTION",
        "LedgerSettings",
        "close_process_ledgers",
        "process_ledger",
    ],
)
