"""Session keys: each session's key names it and only it; a changed key names no session."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sessions.gateway.keys import SessionKeys

KEYS = SessionKeys(b"0123456789abcdef-test-gateway-key")
_ids = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=128)


@given(session_id=_ids)
def test_a_key_names_its_session(session_id: str) -> None:
    assert KEYS.session_of(KEYS.key_for(session_id)) == session_id
    assert not KEYS.is_admin(KEYS.key_for(session_id))


@given(session_id=_ids, position=st.integers(0, 10_000), replacement=st.characters())
def test_a_changed_key_names_no_session(session_id: str, position: int, replacement: str) -> None:
    key = KEYS.key_for(session_id)
    index = position % len(key)
    changed = key[:index] + replacement + key[index + 1 :]
    if changed != key:
        named = KEYS.session_of(changed)
        # base64's padding bits may decode two spellings to one id: still that session's key
        assert named is None or named == session_id


@given(a=_ids, b=_ids)
def test_another_gateway_key_makes_other_keys(a: str, b: str) -> None:
    other = SessionKeys(b"another-gateway-key-0123456789")
    assert other.session_of(KEYS.key_for(a)) is None
    assert (KEYS.key_for(a) == KEYS.key_for(b)) == (a == b)
    assert KEYS.is_admin(KEYS.admin_key()) and not other.is_admin(KEYS.admin_key())
