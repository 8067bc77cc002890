"""A gateway's configuration is refused where it is made, with what to do."""

from __future__ import annotations

import pytest

from sessions.errors import ConfigError
from sessions.gateway.keys import SessionKeys
from sessions.gateway.settings import GatewaySettings
from sessions.gateway.upstream import Upstreams


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"upstreams": "http://one"}, "list of URLs"),
        ({"upstreams": ["x"], "max_body_bytes": 0}, "max_body_bytes"),
        ({"upstreams": ["x"], "timeout_s": -1}, "timeout_s"),
        ({"upstreams": ["x"], "down_for_s": True}, "down_for_s"),
        ({"upstreams": ["x"], "untrainable_reason": "Bad Reason"}, "untrainable_reason"),
        ({"upstreams": ["x"], "untrainable_reason": "orphaned"}, "recovery sweep"),
    ],
)
def test_bad_settings_are_refused(options: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        GatewaySettings(**options)


@pytest.mark.parametrize(
    ("urls", "says"), [([], "at least one"), (["ftp://x"], "http://"), ([None], "http://")]
)
async def test_bad_upstreams_are_refused(urls: list, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Upstreams(urls)


def test_a_short_gateway_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="16 random bytes"):
        SessionKeys(b"short")
