"""The projection decoder's JSON parser (orjson, with the stdlib as fallback) reads exactly what
`json.loads` reads.

Replay and audit must rebuild the read models an older log was projected into, whatever encoder
wrote its `data` (the stdlib's `json.dumps`, compact or not, or orjson's). orjson refuses some of
what the stdlib reads (NaN / Infinity, lone surrogates, floats that overflow to inf) and reads an
integer beyond 64 bits as a float: each of those must come out as `json.loads` has it. Values are
compared by `repr`, which tells 1 from 1.0 from True, -0.0 from 0.0, and keeps key order and NaN.

The other way, the rebuild's JSON columns are serialised by a cached C encoder that must give
`json.dumps`' text.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sessions.projection import decoding
from sessions.projection.decoding import Decoder, parse_json
from store import StoredJSONError, bulk_read_models, load_json

_CHARS = st.characters(exclude_categories=())  # lone surrogates and control characters too
_KEYS = st.text(_CHARS, max_size=8)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # unbounded: beyond 64 bits too
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(_CHARS, max_size=12),
    st.from_regex(r"[0-9]{17,22}", fullmatch=True),  # a long digit run inside a string
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEYS, inner, max_size=4)),
    max_leaves=16,
)
#: How a writer of the log may have encoded `data`.
_ENCODERS = {
    "json.dumps": json.dumps,
    "json.dumps, compact": lambda v: json.dumps(v, separators=(",", ":")),
    "json.dumps, utf-8": lambda v: json.dumps(v, ensure_ascii=False),
    "orjson.dumps": lambda v: orjson.dumps(v).decode(),
}
#: Number literals as any JSON writer may spell them: long mantissas, big exponents, big ints.
_NUMBERS = st.from_regex(
    r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE][+-]?[0-9]{1,3})?", fullmatch=True
)
_WHITESPACE = st.text(st.sampled_from(" \t\n\r\x0b\x0c\u00a0\ufeff"), max_size=2)


def _stdlib(text: str) -> tuple[str, Any]:
    """What `json.loads` makes of `text`: ("ok", repr of the value) or ("error", None)."""
    try:
        return "ok", repr(json.loads(text))
    except ValueError:
        return "error", None


def _ours(text: str) -> tuple[str, Any]:
    try:
        return "ok", repr(parse_json(text))
    except StoredJSONError:
        return "error", None


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, encoder=st.sampled_from(sorted(_ENCODERS)))
@example(value=float("nan"), encoder="json.dumps")
@example(value={"reward": float("inf"), "info": {"x": float("-inf")}}, encoder="json.dumps")
@example(value={"big": 2**64, "small": -(2**63) - 1, "huge": 10**40}, encoder="json.dumps")
@example(value={"edge": 2**64 - 1, "low": -(2**63)}, encoder="json.dumps")
@example(value={"message": "\ud800 lone"}, encoder="json.dumps")
@example(value={"message": "\ud800 lone"}, encoder="json.dumps, utf-8")
@example(value={"id": "s-12345678901234567890"}, encoder="json.dumps")
def test_parse_json_reads_what_the_stdlib_reads(value: Any, encoder: str) -> None:
    try:
        text = _ENCODERS[encoder](value)
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return  # that encoder cannot write this value, so no log holds it
    assert _ours(text) == _stdlib(text)


@settings(max_examples=300, deadline=None)
@given(number=_NUMBERS, before=_WHITESPACE, after=_WHITESPACE)
@example(number="1e400", before="", after="")
@example(number="-1e400", before="", after="")
@example(number="18446744073709551616", before="", after="")
@example(number="-9223372036854775809", before="", after="")
@example(number="1.00000000000000011102230246251565404236316680908203125", before="", after="")
def test_number_literals_and_surrounding_whitespace(number: str, before: str, after: str) -> None:
    for text in (number, f"{before}{number}{after}", f'{before}{{"v": [{number}]}}{after}'):
        assert _ours(text) == _stdlib(text), text


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.text(_CHARS, max_size=30),
        st.text(st.sampled_from('{}[]",:0123456789.eE-+ tfnaluNIy\\'), max_size=30),
    )
)
@example(text="NaN")
@example(text="[Infinity, -Infinity]")
@example(text='{"a": 1, "a": 2}')
@example(text='"\\ud83d\\ude00"')
@example(text="[1,]")
def test_any_text_parses_or_fails_as_with_the_stdlib(text: str) -> None:
    assert _ours(text) == _stdlib(text)


@pytest.mark.parametrize(
    "text",
    ["NaN", '{"reward": Infinity}', "[1e999]", '{"n": 123456789012345678901234}', '"\\udcff"'],
)
def test_fallback_cases_decode_as_the_stdlib_does(text: str) -> None:
    """orjson refuses or misreads each of these; the stdlib's value comes back."""
    orjson_reads = True
    try:
        orjson_reads = repr(orjson.loads(text)) == repr(json.loads(text))
    except orjson.JSONDecodeError:
        orjson_reads = False
    assert not orjson_reads  # the case exercises the fallback
    assert repr(parse_json(text)) == repr(json.loads(text))


def test_malformed_json_keeps_the_stored_json_error() -> None:
    with pytest.raises(StoredJSONError, match="stored JSON is malformed"):
        parse_json('{"reward": 1.0')


@settings(max_examples=150, deadline=None)
@given(
    reward=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers()),
    info=st.dictionaries(_KEYS, _SCALARS, max_size=3),
    encoder=st.sampled_from(sorted(_ENCODERS)),
)
def test_decoder_events_equal_a_stdlib_decoders(
    reward: Any, info: dict[str, Any], encoder: str
) -> None:
    """What the rules get (data cleaned and checked, problems, the cache's second reading of the
    same text) equals what a decoder parsing with `json.loads` alone gives."""
    try:
        text = _ENCODERS[encoder]({"reward": reward, "info": info})
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return
    rows = [(position, "s", position, "RewardPosted", 1, text, None) for position in (1, 2)]
    ours = Decoder().events(rows)
    with mock.patch.object(decoding, "parse_json", load_json):
        stdlib = Decoder().events(rows)
    assert repr(ours) == repr(stdlib)


@settings(max_examples=300, deadline=None)
@given(value=_VALUES)
def test_read_model_json_text_is_json_dumps(value: Any) -> None:
    """The rebuild's JSON columns (reward_info, members, tags) are written as the incremental
    projector writes them through SQLAlchemy's JSON type: `json.dumps`' text, byte for byte."""
    try:
        expected = json.dumps(value)
    except ValueError:  # pragma: no cover - json.dumps allows NaN and takes any of these values
        return
    assert bulk_read_models._dumps(value) == expected
