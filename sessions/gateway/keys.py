"""Per-session secrets derived from one gateway key, so the gateway keeps no table of keys.

A session's key is `rlg_<session id, base64url>.<HMAC-SHA256 of the id under the gateway key>`:
the gateway reads the session from the key and checks the MAC in constant time; a caller who
holds one session's key can neither reach another session nor forge a key. The training side's
own key (to create and end sessions over HTTP) is the MAC of a label no session id can take.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import secrets

from sessions.errors import ConfigError
from sessions.vocabulary import MAX_NAME_LENGTH

__all__ = ["KEY_PREFIX", "MAX_KEY_LENGTH", "SessionKeys", "new_gateway_key"]

KEY_PREFIX = "rlg_"
#: The longest key: a session id of the most characters, each 4 bytes of UTF-8, in base64, plus
#: the prefix, a dot and 64 hex digits.
MAX_KEY_LENGTH = len(KEY_PREFIX) + 4 * math.ceil(4 * MAX_NAME_LENGTH / 3) + 1 + 64
_ADMIN_LABEL = b"\x00training-side"  # a NUL: no session id (a checked name) can spell it


def new_gateway_key() -> bytes:
    """A fresh random gateway key (32 bytes)."""
    return secrets.token_bytes(32)


class SessionKeys:
    """Derive and check session keys under one gateway key."""

    def __init__(self, gateway_key: bytes) -> None:
        if not isinstance(gateway_key, bytes) or len(gateway_key) < 16:
            raise ConfigError(
                "the gateway key must be at least 16 random bytes (e.g. new_gateway_key()); "
                f"got {type(gateway_key).__name__} of length {len(gateway_key) if isinstance(gateway_key, bytes) else '?'}"
            )
        self._key = gateway_key

    def _mac(self, message: bytes) -> str:
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def key_for(self, session_id: str) -> str:
        """The secret an agent of `session_id` presents as its API key."""
        encoded = base64.urlsafe_b64encode(session_id.encode()).decode().rstrip("=")
        return f"{KEY_PREFIX}{encoded}.{self._mac(session_id.encode())}"

    def session_of(self, key: str) -> str | None:
        """The session a key was made for, or None when it is not a key this gateway made."""
        if not key.startswith(KEY_PREFIX) or len(key) > MAX_KEY_LENGTH or not key.isascii():
            return None
        encoded, dot, mac = key[len(KEY_PREFIX) :].partition(".")
        if not dot or not encoded:
            return None
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            session_id = raw.decode()
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(mac, self._mac(raw)):
            return None
        return session_id

    def admin_key(self) -> str:
        """The training side's key: create sessions, post rewards, end sessions over HTTP."""
        return f"{KEY_PREFIX}admin.{self._mac(_ADMIN_LABEL)}"

    def is_admin(self, key: str) -> bool:
        return len(key) <= MAX_KEY_LENGTH and hmac.compare_digest(
            key.encode(errors="replace"), self.admin_key().encode()
        )
