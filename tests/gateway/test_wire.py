"""The wire format's fast paths read exactly what the stdlib reads: `wire.loads` is orjson where
orjson agrees with `json.loads` and the stdlib elsewhere (NaN, integers beyond 64 bits, bodies
that are not UTF-8 JSON), and the token-id check accepts lists of integers only."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sessions.gateway import wire

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)  # beyond 64 bits too
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_DOCUMENTS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, and of the same types (an int must not come back a float)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(_DOCUMENTS, st.booleans())
def test_loads_reads_a_document_as_the_stdlib_does(document: Any, ascii_only: bool) -> None:
    raw = json.dumps(document, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    try:
        expected = json.loads(raw)
    except ValueError as error:  # a lone surrogate's bytes: the stdlib refuses them
        expected = type(error)
    try:
        got = wire.loads(raw)
    except ValueError as error:
        got = type(error)
    assert _same(got, expected)


@given(st.binary(max_size=64) | st.sampled_from([b"\xef\xbb\xbf{}", b"NaN", b"[1e400]", b"{"]))
def test_loads_refuses_or_reads_any_bytes_as_the_stdlib_does(raw: bytes) -> None:
    def outcome(read: Any) -> Any:
        try:
            return read(raw)
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            return type(error)

    assert _same(outcome(wire.loads), outcome(json.loads))


@given(st.lists(st.integers(min_value=-(2**70), max_value=2**70) | st.booleans() | st.floats()))
def test_token_ids_are_lists_of_integers_only(values: list[Any]) -> None:
    expected = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    assert (wire._ids(values) is values) is expected
    assert wire._ids(tuple(values)) is None
