"""The placeholder policy: which failed sessions become reward-0 rows (DESIGN §5).

The decision is made when the session fails and recorded in its `SessionFailed` event, so replay
never depends on today's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from sessions.events import FAILURE_REASONS

__all__ = [
    "ANY",
    "Decision",
    "GROUP_UID",
    "PARTITIONS",
    "PLACEHOLDER_UID_SEPARATOR",
    "PlaceholderPolicy",
    "isolated_uid",
]

Decision = Literal["emit", "drop"]
PARTITIONS = ("train", "val")
ANY = "*"

#: The column (or TransferQueue field) that keeps a row's prompt uid when its `uid` is isolated.
GROUP_UID = "group_uid"
#: What an isolated placeholder's uid is made of: `{uid}-ph{session_index}` (no `_`: verl splits
#: queue keys on it).
PLACEHOLDER_UID_SEPARATOR = "-ph"


def isolated_uid(uid: str, session_index: object) -> str:
    """A placeholder's own uid, so stock GRPO makes it a group of one and keeps its 0 out of its
    siblings' baseline: one rule for the verl adapter (V0 batches) and the TransferQueue sink (V1)."""
    return f"{uid}{PLACEHOLDER_UID_SEPARATOR}{session_index}"


@dataclass(frozen=True)
class PlaceholderPolicy:
    """`rules[partition][reason]` -> emit/drop; `"*"` matches any partition or reason.

    Example: drop infrastructure failures from training but keep policy-caused ones as zeros::

        PlaceholderPolicy(rules={"train": {"sandbox_error": "drop"}})
    """

    default: Decision = "emit"
    rules: Mapping[str, Mapping[str, Decision]] = field(default_factory=dict)
    token_id: int = 0

    def __post_init__(self) -> None:
        _check_decision("default", self.default)
        for partition, by_reason in self.rules.items():
            if partition not in (*PARTITIONS, ANY):
                raise ValueError(f"placeholder policy: unknown partition {partition!r}; use train, val or '*'")
            for reason, decision in by_reason.items():
                if reason not in (*FAILURE_REASONS, ANY):
                    raise ValueError(
                        f"placeholder policy: unknown failure reason {reason!r}; use one of {', '.join(FAILURE_REASONS)} or '*'"
                    )
                _check_decision(f"rules[{partition!r}][{reason!r}]", decision)
        if not 0 <= self.token_id < 2**31:
            raise ValueError(f"placeholder policy: token_id {self.token_id} must be in [0, 2**31)")

    def decide(self, partition: str, reason: str) -> Decision:
        for p in (partition, ANY):
            by_reason = self.rules.get(p, {})
            for r in (reason, ANY):
                if r in by_reason:
                    return by_reason[r]
        return self.default


def _check_decision(where: str, decision: str) -> None:
    if decision not in ("emit", "drop"):
        raise ValueError(f"placeholder policy: {where} is {decision!r}; use 'emit' or 'drop'")
