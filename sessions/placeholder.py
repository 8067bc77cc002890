"""The placeholder policy: which failed sessions become reward-0 rows (docs/design.md §5).

The decision is made when the session fails and recorded in its `SessionFailed` event, so replay
never depends on today's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from sessions.errors import ConfigError
from sessions.failure_policy import check_rules, match
from sessions.vocabulary import POLICY

__all__ = [
    "DECISIONS",
    "DROP",
    "Decision",
    "EMIT",
    "KEEP_PARTIAL",
    "GROUP_UID",
    "PlaceholderPolicy",
    "isolated_uid",
]

Decision = Literal["emit", "drop", "keep_partial"]
#: The failed session becomes one reward-0 placeholder row (the default).
EMIT: Decision = "emit"
#: No row for the failed session.
DROP: Decision = "drop"
#: A failed session with a posted reward and a trajectory sends that trajectory (`is_partial`).
KEEP_PARTIAL: Decision = "keep_partial"
#: The placeholder policy's choices.
DECISIONS: tuple[Decision, ...] = (EMIT, DROP, KEEP_PARTIAL)
#: A placeholder longer than this is surely a mistake (it is padding the whole batch pays for).
_MAX_PLACEHOLDER_LENGTH = 65_536

#: The column (or TransferQueue field) that keeps a row's prompt uid when its `uid` is isolated.
GROUP_UID = "group_uid"
#: What an isolated placeholder's uid is made of: `{uid}-ph{session_index}` (no `_`: verl splits
#: queue keys on it).
_PLACEHOLDER_UID_SEPARATOR = "-ph"


def isolated_uid(uid: str, session_index: object) -> str:
    """A placeholder's own uid, so stock GRPO makes it a group of one and keeps its 0 out of its
    siblings' baseline: one rule for the verl adapter (V0 batches) and the TransferQueue sink (V1)."""
    return f"{uid}{_PLACEHOLDER_UID_SEPARATOR}{session_index}"


@dataclass(frozen=True)
class PlaceholderPolicy:
    """`rules[partition][reason or origin]` -> emit / drop / keep_partial; `"*"` matches any.

    - `emit` (default): the failed session becomes one reward-0 placeholder row.
    - `drop`: no row (the group files under a smaller `reward/mean@k`).
    - `keep_partial`: when the session has a posted reward and a trajectory, its selected
      trajectory goes to the batch with that reward (`is_partial`, `failure_reason` kept);
      otherwise it falls back to `emit`.

    `prompt_length` / `response_length` size the placeholder (default 1 + 1; Megatron context
    parallelism needs at least 2·tp·cp tokens per row): every token attended, mask 0, reward 0.
    Example, drop infrastructure failures from training but keep policy-caused ones as zeros::

        PlaceholderPolicy(rules={"train": {"infra": "drop"}})
    """

    default: Decision = EMIT
    rules: Mapping[str, Mapping[str, Decision]] = field(default_factory=dict)
    token_id: int = 0
    prompt_length: int = 1
    response_length: int = 1

    def __post_init__(self) -> None:
        _check_decision("default", self.default)
        check_rules("placeholder policy", self.rules, DECISIONS)
        if (
            isinstance(self.token_id, bool)
            or not isinstance(self.token_id, int)
            or not 0 <= self.token_id < 2**31
        ):
            raise ConfigError(
                f"placeholder policy: token_id {self.token_id!r} must be an integer in [0, 2**31)"
            )
        for name in ("prompt_length", "response_length"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 1 <= value <= _MAX_PLACEHOLDER_LENGTH
            ):
                raise ConfigError(
                    f"placeholder policy: {name} must be an integer in [1, {_MAX_PLACEHOLDER_LENGTH}], got {value!r} "
                    "(for context parallelism use at least 2*tp*cp)"
                )

    def decide(self, partition: str, reason: str, origin: str = POLICY) -> Decision:
        return match(self.rules, partition, reason, origin, self.default)  # type: ignore[no-any-return]

    def as_config(self) -> dict[str, object]:
        return {
            "default": self.default,
            "rules": {p: dict(sorted(r.items())) for p, r in sorted(self.rules.items())},
            "token_id": self.token_id,
            "prompt_length": self.prompt_length,
            "response_length": self.response_length,
        }


def _check_decision(where: str, decision: str) -> None:
    if not isinstance(decision, str) or decision not in DECISIONS:
        raise ConfigError(
            f"placeholder policy: {where} is {decision!r}; use {', '.join(map(repr, DECISIONS))}"
        )
