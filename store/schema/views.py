"""The documented SQL views (created by Alembic revisions 0002, 0005, 0009 and 0010, described in docs/sql.md).

Views are pure SQL over `events` and the read models, so they are as rebuildable as the tables
they read. They are not part of `store.schema.tables.metadata` (Alembic's autogenerate compares tables
only), so this module is where code and tests enumerate them. No import of `sessions` here.
"""

from __future__ import annotations

SESSION_TIMELINE = "session_timeline"
FAILURE_BREAKDOWN = "failure_breakdown"
REWARD_BY_STEP = "reward_by_step"
GROUP_STATUS = "group_status"
#: One row per attempt of a session, read from the log (revision 0005).
_SESSION_ATTEMPTS = "session_attempts"
#: Each session's launch and whether a later launch superseded it (revision 0009).
SESSION_LAUNCHES = "session_launches"
#: One row per model call, read from the log (revision 0010).
_MODEL_CALLS = "model_calls"

#: Every view the schema defines at head, in creation order.
VIEWS = (
    SESSION_TIMELINE,
    FAILURE_BREAKDOWN,
    REWARD_BY_STEP,
    GROUP_STATUS,
    _SESSION_ATTEMPTS,
    SESSION_LAUNCHES,
    _MODEL_CALLS,
)
