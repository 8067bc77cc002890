"""``python -m sessions.integrations.verl.agent_loop``: print the agent-loop config file's path,
for ``actor_rollout_ref.rollout.agent.agent_loop_config_path=$(python -m ...)``."""

from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG

print(AGENT_LOOP_CONFIG)
