"""The attribute and event names a session's spans carry, declared once (the table in
docs/otel.md is this module).

OpenTelemetry's GenAI semantic conventions name what an agent conversation and a model call
carry; those names are used where they fit. What the conventions have no name for (the run, the
group, the slot, a failure's origin, the placeholder, weights versions) goes under
`rollout_ledger.*`. A few OpenInference names (`openinference.span.kind`, `session.id`,
`llm.token_count.*`) are added beside them because Arize Phoenix files and totals spans by those.
"""

from __future__ import annotations

__all__ = [
    "ATTEMPT",
    "CALL_ID",
    "CALL_OUTCOME",
    "CALL_SERVER",
    "CALL_TEXT",
    "CALL_TURN",
    "CALL_LATENCY_S",
    "CONVERSATION_ID",
    "DATA_SOURCE",
    "ERROR_TYPE",
    "EVENT_ATTEMPT_FAILED",
    "EVENT_CANCELLED",
    "EVENT_EXCEPTION",
    "EVENT_PLACEHOLDER",
    "EVENT_REWARD",
    "EVENT_TRAJECTORY",
    "FAILURE_ERROR_TYPE",
    "FAILURE_MESSAGE",
    "FAILURE_ORIGIN",
    "FAILURE_REASON",
    "GROUP",
    "GROUP_SIZE",
    "INPUT_TOKENS",
    "LAUNCH",
    "MAX_VERSION",
    "METRIC_POLICY",
    "MIN_VERSION",
    "MODEL",
    "OPERATION",
    "OUTCOME",
    "OUTPUT_TOKENS",
    "PARTITION",
    "PHOENIX_KIND",
    "PHOENIX_SESSION",
    "PHOENIX_TOKENS_COMPLETION",
    "PHOENIX_TOKENS_PROMPT",
    "PLACEHOLDER",
    "PLACEHOLDER_POLICY",
    "FINISH_REASONS",
    "REWARD",
    "RUN",
    "RUNNER",
    "SCHEMA_URL",
    "SCORE_SOURCE",
    "SERVICE_NAME",
    "SESSION_ID",
    "SLOT",
    "STEP",
    "VERSION_REQUESTED",
]

#: The semantic-conventions version the GenAI names below follow (the scope's schema URL).
SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"
#: The resource's service.name: one service per ledger export.
SERVICE_NAME = "rollout-ledger"

# --- GenAI semantic conventions ---------------------------------------------------------------
OPERATION = "gen_ai.operation.name"  # invoke_agent (session, attempt) | chat (model call)
CONVERSATION_ID = "gen_ai.conversation.id"  # the session id
MODEL = "gen_ai.request.model"  # a call's sampling["model"], when the runner gave one
INPUT_TOKENS = "gen_ai.usage.input_tokens"  # a call's whole prompt; a session's: its calls' sum
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"  # a call's response; a session's: its calls' sum
FINISH_REASONS = "gen_ai.response.finish_reasons"
RUNNER = "gen_ai.agent.name"  # the session's runner
ERROR_TYPE = "error.type"  # a failure's error type, else its reason

# --- rollout-ledger's own ---------------------------------------------------------------------
SESSION_ID = "rollout_ledger.session_id"
RUN = "rollout_ledger.run"
PARTITION = "rollout_ledger.partition"
STEP = "rollout_ledger.step"
GROUP = "rollout_ledger.group"  # the group's uid
GROUP_SIZE = "rollout_ledger.group_size"
SLOT = "rollout_ledger.slot"  # the session's index in its group
DATA_SOURCE = "rollout_ledger.data_source"
LAUNCH = "rollout_ledger.launch"
ATTEMPT = "rollout_ledger.attempt"  # an attempt's number; on the session: how many it took
OUTCOME = "rollout_ledger.outcome"  # succeeded | failed | cancelled | open
REWARD = "rollout_ledger.reward"
SCORE_SOURCE = "rollout_ledger.score_source"
FAILURE_REASON = "rollout_ledger.failure.reason"
FAILURE_ORIGIN = "rollout_ledger.failure.origin"
FAILURE_ERROR_TYPE = "rollout_ledger.failure.error_type"
FAILURE_MESSAGE = "rollout_ledger.failure.message"
METRIC_POLICY = "rollout_ledger.failure.metric_policy"
PLACEHOLDER = "rollout_ledger.placeholder"  # true: the failed session stands in the batch as a placeholder row
PLACEHOLDER_POLICY = "rollout_ledger.placeholder.policy"  # emit | drop | keep_partial
CALL_ID = "rollout_ledger.call.id"
CALL_TURN = "rollout_ledger.call.turn"
CALL_OUTCOME = "rollout_ledger.call.outcome"  # recorded | failed | open
CALL_LATENCY_S = "rollout_ledger.call.latency_s"
CALL_SERVER = "rollout_ledger.call.server"
CALL_TEXT = "rollout_ledger.call.text"
VERSION_REQUESTED = "rollout_ledger.weights.requested"
MIN_VERSION = "rollout_ledger.weights.min_version"
MAX_VERSION = "rollout_ledger.weights.max_version"

# --- span events ------------------------------------------------------------------------------
EVENT_REWARD = "rollout_ledger.reward"
EVENT_TRAJECTORY = "rollout_ledger.trajectory"
EVENT_ATTEMPT_FAILED = "rollout_ledger.attempt_failed"
EVENT_PLACEHOLDER = "rollout_ledger.placeholder"
EVENT_CANCELLED = "rollout_ledger.cancelled"
EVENT_EXCEPTION = "exception"  # OpenTelemetry's exception event: viewers show it as the error

# --- OpenInference, for Arize Phoenix ---------------------------------------------------------
PHOENIX_KIND = "openinference.span.kind"  # AGENT (session), CHAIN (attempt), LLM (call)
PHOENIX_SESSION = "session.id"
PHOENIX_TOKENS_PROMPT = "llm.token_count.prompt"
PHOENIX_TOKENS_COMPLETION = "llm.token_count.completion"
