"""The gateway's settings, checked once where they are made."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sessions.errors import ConfigError
from sessions.gateway.keys import new_gateway_key
from sessions.vocabulary import reason_problem

__all__ = ["DEFAULT_MAX_BODY_BYTES", "GatewaySettings", "MISSING_TOKEN_IDS"]

#: A request body larger than this is refused (413) before it is parsed.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
#: The reason a session ends with when one of its calls could not be recorded with token ids.
MISSING_TOKEN_IDS = "missing_token_ids"


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What a gateway serves and how (docs/gateway.md).

    `upstreams`: the inference servers' base URLs (`http://host:port`, the `/v1/...` paths are
    appended). `key`: the gateway key every session secret is derived from (keep it to let
    agents' keys survive a restart; default: a fresh random one). `weights_version_header` /
    `weights_version_field`: where the server's answer names the weights version that served it
    (a response header, else a top-level JSON field of the response or of any streamed chunk).
    """

    upstreams: Sequence[str]
    key: bytes = field(default_factory=new_gateway_key, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    weights_version_header: str | None = "x-weights-version"
    weights_version_field: str | None = "weights_version"
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    down_for_s: float = 10.0
    untrainable_reason: str = MISSING_TOKEN_IDS

    def __post_init__(self) -> None:
        if isinstance(self.upstreams, str):
            raise ConfigError("upstreams is a list of URLs, got one string; wrap it in a list")
        for name in ("max_body_bytes",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("timeout_s", "connect_timeout_s", "down_for_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        problem = reason_problem(self.untrainable_reason, runner=True)
        if problem:
            raise ConfigError(f"untrainable_reason: {problem}")
