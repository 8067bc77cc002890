"""Bad input, in one matrix: every field of every command (docs/design.md §4, "Nothing is appended that
the projector cannot project").

Each case runs one command with one odd value and asserts one of two outcomes:

* refused — `InvalidInput` naming the field (and the session), nothing appended, the session
  still usable afterwards (a valid follow-up command succeeds; a refused creation left nothing
  behind, so the same id can be created);
* accepted — free text (messages, error types, `extra`, reward `info`, `metadata`) is made
  storable rather than refused: NUL becomes `\\x00`, a lone surrogate `\\udXXX`, over-long text is
  cut to its column — and what is stored is checked.

Either way the case ends with `ledger.project()` quarantining nothing of its sessions and their
read-model rows holding what was stored; `audit` of the shared database (one per backend, emptied
first) runs once after the matrix and names the case of any divergence — one audit per case would
rebuild the whole shared log each time. Cases on a database of their own audit it themselves. The odd values are generated from the storable declaration (`sessions.storable`, the
column specs of `store.columns`): each field's column length, integer range, minimum and choices
give its bad values, so a column that changes moves its cases with it. The token arrays are
generated over dtypes (numpy and torch, including bfloat16/float16/int8/bool and the 'meta'
device) and shapes. The identity and trajectory cases of tests/domain/test_recorder.py and the size caps
(`Ledger.open(max_event_bytes=…, max_session_events=…, max_session_bytes=…)`) are cases here too.

Damage to the stored log (malformed JSON, an event type or schema version from the future, data of
the wrong shape) is tested on a database of its own at the end: since docs/design.md §7 the projector
quarantines such an event (tests/projection/test_quarantine.py) rather than stopping at it.

Cases where the library does not (yet) behave as the contract says carry a `Bug`: on the
backends it names, the case must fail with that exception (reported as xfail) — and fails
outright once the library is fixed, so the mark gets removed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.exc import DBAPIError

from sessions import InvalidInput, Ledger, UnknownEventError
from sessions import events as ev
from sessions.audit.auditing import audit
from sessions.recorder import (
    MAX_EVENT_BYTES,
    MAX_SESSION_BYTES,
    MAX_SESSION_EVENTS,
    Limits,
    SessionHandle,
)
from sessions.storable import DECLARATION, Field
from store import column_spec
from store.schema.tables import events, projection_errors
from store.schema.tables import sessions as sessions_table
from store.stored_json import StoredJSONError
from tests import crash_workers as cw
from tests.conftest import backend_of, wipe
from tests.domain.test_recorder import BAD_IDENTITIES, BAD_TRAJECTORIES

torch = pytest.importorskip("torch")

CAPS = {"max_event_bytes": 16 * 1024, "max_session_events": 8, "max_session_bytes": 48 * 1024}
GOOD = {"prompt_ids": [1, 2], "response_ids": [3, 4]}
BLOB = "x" * 20_000  # JSON over max_event_bytes


def kw(**overrides: Any) -> dict[str, Any]:
    """Identity keywords of a session in a group of its own (a fresh uid per call: a group refuses
    a second session with the same session_index)."""
    return {
        "uid": f"u{uuid.uuid4().hex[:12]}",
        "session_index": 0,
        "group_size": 1,
        "partition": "val",
        "global_step": 0,
        **overrides,
    }


def fresh_id(prefix: str = "bad") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def escaped(value: str, limit: int | None = None) -> str:
    """The contract's spelling of free text made storable: NUL as `\\x00`, a lone surrogate as
    `\\uXXXX`, then cut to the column."""
    out = "".join(
        "\\x00" if c == "\x00" else f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c
        for c in value
    )
    return out if limit is None else out[:limit]


def escaped_json(value: Any) -> Any:
    """`escaped` through a JSON value, keys included (a non-string key becomes its str)."""
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        return {escaped(str(k)): escaped_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escaped_json(v) for v in value]
    return value


# ------------------------------------------------------------------------------ known bugs
@dataclass(frozen=True)
class Bug:
    """A case the library gets wrong today: on `backends` it fails with `raises`."""

    reason: str
    raises: type[BaseException] | tuple[type[BaseException], ...]
    backends: tuple[str, ...] = ("sqlite", "postgres")


class SessionNotNamed(AssertionError):
    """A refusal that names the field but not the session (`InvalidInput.session_id`)."""


class WrongMessage(AssertionError):
    """A refusal whose message misreports the value."""


@contextlib.contextmanager
def known_bug(bug: Bug | None, backend: str) -> Iterator[None]:
    """Strict xfail, per backend: the bug must show (as xfail) where it is known to, and a case
    that passes there fails, so the mark is removed with the fix."""
    if bug is None or backend not in bug.backends:
        yield
        return
    try:
        yield
    except bug.raises as error:
        pytest.xfail(f"library bug: {bug.reason} ({type(error).__name__}: {str(error)[:120]})")
    pytest.fail(f"known bug no longer shows on {backend}; remove its mark: {bug.reason}")


# ------------------------------------------------------------------------------ the case model
#: (ledger, session id, the session's handle or None, the case's context) -> the command's result
Act = Callable[[Ledger, str, "SessionHandle | None", dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class Stored:
    """Accepted: the last `event` of the session holds `expect` in `name` (`arrays`: the decoded
    token arrays' `name`); after projection its `sessions` row holds `column_expect` in `column`."""

    event: str
    name: str
    expect: Any
    column: str | None = None
    column_expect: Any = None


@dataclass(frozen=True)
class Case:
    id: str
    command: str  # create | start | record | reward | complete | fail | cancel
    field: str  # the command's argument the value is given to (and the field a refusal names)
    act: Act
    stored: Stored | None = None  # None: the command must be refused
    setup: Act | None = None  # more valid commands first
    mentions: tuple[str, ...] = ()  # further text a refusal's message must hold
    capped: bool = False  # run on the ledger with CAPS
    bug: Bug | None = None
    follow_up: str = (
        "trajectory"  # after a refusal on a running session: record + complete, or just "complete"
    )
    own_database: bool = (
        False  # a known bug accepts a value the projector then cannot project: keep it apart
    )
    not_mentioned: tuple[
        str, ...
    ] = ()  # text a refusal's message must not hold (a wrong diagnosis)


def _label(value: Any) -> str:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > 12:
        return f"{type(value).__name__}[{len(value)}]"
    return f"{value!r:.24}"


# ------------------------------------------------------------------------------ value generators
def _field(type_: str, name: str) -> tuple[Field, Any]:
    declared = DECLARATION[type_][name]
    return declared, declared.spec()


def bad_texts(
    declared: Field, spec: Any, *, none_is_default: bool = False
) -> list[tuple[str, Any]]:
    """Values a short-text column refuses: other types, too long, empty, NUL, a lone surrogate,
    a forbidden character, None where it is not nullable."""
    out: list[tuple[str, Any]] = [("int", 1), ("bytes", b"ab"), ("list", ["ab"])]
    if not spec.nullable and not none_is_default:
        out.append(("none", None))
    if spec.max_length is not None:
        out.append((f"{spec.max_length + 1}-chars", "x" * (spec.max_length + 1)))
    if declared.minimum:
        out.append(("empty", ""))
    out += [("nul", "a\x00b"), ("lone-surrogate", "a\ud800b")]
    out += [(f"contains-{char}", f"a{char}b") for char in declared.forbidden]
    return out


def good_texts(declared: Field, spec: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("unicode", "é☃🙂-ok")]
    if spec.max_length is not None:
        out.append((f"{spec.max_length}-chars", "y" * spec.max_length))
    if "_" not in declared.forbidden:
        out.append(("underscore", "a_b"))
    if spec.nullable:
        out.append(("none", None))
    return out


def bad_ints(declared: Field, spec: Any) -> list[tuple[str, Any]]:
    low, high = spec.int_range
    out: list[tuple[str, Any]] = [
        ("above-column-range", high + 1),
        ("10**400", 10**400),
        ("fraction", 1.5),
        ("integral-float", 2.0),
        ("string", "1"),
        ("bool", True),
        ("list", [1]),
    ]
    if declared.minimum is not None:
        out.append(("below-minimum", int(declared.minimum) - 1))
    else:
        out.append(("below-column-range", low - 1))
    if not spec.nullable:
        out.append(("none", None))
    return out


def bad_numbers(declared: Field | None) -> list[tuple[str, Any, Bug | None]]:
    """Values a float field refuses (reward, score, timeout_s)."""
    out: list[tuple[str, Any, Bug | None]] = [
        ("nan", math.nan, None),
        ("inf", math.inf, None),
        ("-inf", -math.inf, None),
        ("10**400", 10**400, None),
        ("-10**400", -(10**400), None),
        ("string", "1.0", None),
        ("bool", True, None),
        ("list", [1.0], None),
        ("complex", 1 + 0j, None),
        ("decimal", Decimal("0.5"), None),
        ("np.float32-nan", np.float32("nan"), None),
        ("np.float64-inf", np.float64("inf"), None),
        ("np.longdouble-1e4000", np.longdouble("1e4000"), None),
    ]
    if declared is not None and declared.minimum is not None:
        out.append(("below-minimum", declared.minimum - 1, None))
        if declared.exclusive_minimum:
            out.append(("at-minimum", declared.minimum, None))
    return out


def good_numbers() -> list[tuple[str, Any, Bug | None]]:
    """Finite numbers of every type a reward may come as, and their float."""
    return [
        ("zero", 0.0, None),
        ("np.float32", np.float32(0.25), None),
        ("np.float16", np.float16(0.5), None),
        ("np.int64", np.int64(3), None),
        ("int", 2, None),
        ("tiny", 5e-324, None),
        ("1e18", 1e18, None),
        ("1e19", 1e19, None),
        ("10**300-int", 10**300, None),
    ]


def bad_json(*, mapping_only: bool) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [
        ("nan", {"x": math.nan}),
        ("inf-nested", {"x": {"y": [math.inf]}}),
        ("object", {"x": object()}),
        ("set", {"x": {1}}),
        ("bytes", {"x": b"ab"}),
    ]
    if not mapping_only:
        out += [("list", [1]), ("string", "ab"), ("int", 1)]
    return out


def good_json(*, string_keys_only: bool) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [
        ("nul-key-and-value", {"k\x00": "v\x00"}),
        ("lone-surrogates", {"\ud800": ["\udcff", {"deep": "a\ud83db"}]}),
        ("underscore-unicode", {"a_b": "é☃🙂"}),
        ("big-int", {"n": 10**30}),
        ("huge-int", {"n": 10**400}),
        ("tuple", {"t": (1, "\x00")}),
        ("long-text", {"t": "y" * 5000}),
        ("nested", {"a": {"b": {"c": [1, 2.5, None, True]}}}),
    ]
    if not string_keys_only:
        out.append(("int-key", {1: "one"}))
    return out


def free_texts(limit: int) -> list[tuple[str, str]]:
    """Free text that is made storable, never refused."""
    return [
        ("nul", "boom\x00here"),
        ("lone-surrogate", "bad \ud800 byte"),
        ("surrogate-only", "\udcff"),
        (f"{limit * 2}-chars", "m" * (limit * 2)),
        ("nul-at-the-cut", "x" * (limit - 2) + "\x00\x00"),
        ("underscore-unicode", "tool_call failed: é☃🙂"),
    ]


NOT_TEXT_VALUES: list[tuple[str, Any, bool]] = [  # (label, value, does today's library accept it)
    ("int", 123, False),
    ("bytes", b"oops", False),
    ("dict", {"a": 1}, False),
    ("list", ["x"], True),
    ("tuple", ("x",), True),
]

#: Token-id arrays: (label, value) refused for prompt_ids and response_ids.
BAD_IDS: list[tuple[str, Any]] = [
    ("empty", []),
    ("2-d", [[1, 2], [3, 4]]),
    ("scalar", 5),
    ("none", None),
    ("string", "12"),
    ("bytes", b"\x01\x02"),
    ("strings", ["1", "2"]),
    ("fraction", [1.5, 2.0]),
    ("nan", [math.nan, 1.0]),
    ("inf", [math.inf]),
    ("negative", [-1, 2]),
    ("2**31", [2**31]),
    ("2**40", [2**40, 3]),
    ("1e20", [1e20]),
    ("ragged", [[1], [2, 3]]),
    ("dict", {"a": 1}),
    ("set", {1, 2}),
    ("object", [object()]),
    ("numpy-uint64-2**63", np.array([2**63], dtype=np.uint64)),
    ("numpy-int8-negative", np.array([1, -1], dtype=np.int8)),
    ("numpy-bool", np.array([True, False])),
    ("numpy-empty", np.array([], dtype=np.int64)),
    ("numpy-complex", np.array([1 + 0j])),
    ("numpy-strings", np.array(["1"])),
    ("torch-bool", torch.tensor([True, False])),
    ("torch-int8-negative", torch.tensor([1, -1], dtype=torch.int8)),
    ("torch-complex", torch.tensor([1 + 0j, 2 + 0j])),
    ("torch-meta", torch.empty(2, dtype=torch.int64, device="meta")),
    ("torch-meta-bfloat16", torch.empty(2, dtype=torch.bfloat16, device="meta")),
    ("torch-2-d", torch.ones(1, 2, dtype=torch.int64)),
    ("torch-0-d", torch.tensor(3)),
    ("torch-empty", torch.tensor([], dtype=torch.int64)),
    ("torch-bfloat16-fraction", torch.tensor([1.5], dtype=torch.bfloat16)),
    ("torch-float16-inf", torch.tensor([math.inf], dtype=torch.float16)),
]
_IDS = [1, 2, 100]
#: Token-id arrays accepted, as exact integers: (label, value, the ids stored).
GOOD_IDS: list[tuple[str, Any, list[int]]] = [
    ("integral-floats", [5.0, 6.0], [5, 6]),
    ("extremes", [0, 2**31 - 1], [0, 2**31 - 1]),
    ("tuple", (7, 8), [7, 8]),
    ("range", range(3, 6), [3, 4, 5]),
    *(
        (f"numpy-{np.dtype(dtype).str}", np.array(_IDS, dtype=dtype), _IDS)
        for dtype in (
            np.int8,
            np.uint8,
            np.int16,
            np.uint16,
            np.int32,
            np.uint32,
            np.int64,
            np.uint64,
            np.float16,
            np.float32,
            np.float64,
            ">i4",
            ">i8",
            ">f8",
        )
    ),
    *(
        (f"torch-{str(dtype).removeprefix('torch.')}", torch.tensor(_IDS, dtype=dtype), _IDS)
        for dtype in (
            torch.bfloat16,
            torch.float16,
            torch.float32,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
        )
    ),
    # bfloat16 holds 8 significant bits: powers of two stay exact far beyond 256
    (
        "torch-bfloat16-large-exact",
        torch.tensor([2**15, 2**17], dtype=torch.bfloat16),
        [2**15, 2**17],
    ),
    ("torch-requires-grad", torch.tensor([1.0, 2.0], requires_grad=True), [1, 2]),
    ("torch-non-contiguous", torch.arange(6)[::2], [0, 2, 4]),
]
#: Masks for GOOD's two response tokens.
BAD_MASKS: list[tuple[str, Any]] = [
    ("too-short", [1]),
    ("too-long", [1, 1, 1]),
    ("value-2", [1, 2]),
    ("negative", [0, -1]),
    ("fraction", [0.5, 1]),
    ("nan", [math.nan, 1]),
    ("string", "10"),
    ("strings", ["1", "0"]),
    ("2-d", [[1, 0]]),
    ("none-inside", [None, 1]),
    ("empty", []),
    ("torch-meta", torch.empty(2, device="meta")),
    ("torch-value-2", torch.tensor([2, 0])),
    ("torch-complex", torch.tensor([1 + 0j, 0j])),
    ("numpy-fraction", np.array([0.5, 1.0])),
]
GOOD_MASKS: list[tuple[str, Any, list[int]]] = [
    ("bools", [True, False], [1, 0]),
    ("ints", [0, 1], [0, 1]),
    ("floats", [1.0, 0.0], [1, 0]),
    ("numpy-uint8", np.array([1, 0], dtype=np.uint8), [1, 0]),
    ("numpy-bool", np.array([False, True]), [0, 1]),
    *(
        (f"torch-{str(dtype).removeprefix('torch.')}", torch.tensor([1, 0]).to(dtype), [1, 0])
        for dtype in (
            torch.bool,
            torch.bfloat16,
            torch.float16,
            torch.int8,
            torch.uint8,
            torch.int64,
        )
    ),
]
BAD_LOGPROBS: list[tuple[str, Any]] = [
    ("nan", [0.0, math.nan]),
    ("-inf", [-math.inf, 0.0]),
    ("too-short", [-0.5]),
    ("too-long", [0.0, 0.0, 0.0]),
    ("string", "ab"),
    ("strings", ["-1", "0"]),
    ("float32-overflow", [-1e300, 0.0]),
    ("2-d", [[0.0, 0.0]]),
    ("bools", [True, False]),
    ("none-inside", [None, 0.0]),
    ("torch-meta", torch.empty(2, device="meta")),
    ("torch-bool", torch.tensor([True, False])),
    ("torch-complex", torch.tensor([1j, 0j])),
    ("torch-float16-nan", torch.tensor([math.nan, 0.0], dtype=torch.float16)),
]
GOOD_LOGPROBS: list[tuple[str, Any, list[float]]] = [
    ("floats", [-0.5, -0.25], [-0.5, -0.25]),
    ("ints", [-1, 0], [-1.0, 0.0]),
    ("numpy-float64", np.array([-0.5, -0.125]), [-0.5, -0.125]),
    ("numpy-float16", np.array([-0.5, -2.0], dtype=np.float16), [-0.5, -2.0]),
    *(
        (
            f"torch-{str(dtype).removeprefix('torch.')}",
            torch.tensor([-0.5, -0.25], dtype=dtype),
            [-0.5, -0.25],
        )
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    ),
]


# ------------------------------------------------------------------------------ commands
def create_with(name: str, value: Any) -> Act:
    async def act(ledger: Ledger, sid: str, _handle: Any, ctx: dict[str, Any]) -> Any:
        if name == "session_id":
            return await ledger.create_session(value, **kw())
        return await ledger.create_session(sid, **kw(**{name: value}))

    return act


def start_with(name: str, value: Any) -> Act:
    return lambda _ledger, _sid, handle, _ctx: handle.start(**{name: value})


def record_with(name: str, value: Any) -> Act:
    return lambda _ledger, _sid, handle, _ctx: handle.record_trajectory(**{**GOOD, name: value})


def reward_with(name: str, value: Any) -> Act:
    if name == "info":
        return lambda _ledger, _sid, handle, _ctx: handle.post_reward(0.5, **value)
    return lambda _ledger, _sid, handle, _ctx: handle.post_reward(value)


def complete_with(name: str, value: Any) -> Act:
    return lambda _ledger, _sid, handle, _ctx: handle.complete(**{name: value})


def fail_with(name: str, value: Any) -> Act:
    if name == "reason":
        return lambda _ledger, _sid, handle, _ctx: handle.fail(value)
    return lambda _ledger, _sid, handle, _ctx: handle.fail("runner_error", **{name: value})


def cancel_with(_name: str, value: Any) -> Act:
    return lambda _ledger, _sid, handle, _ctx: handle.cancel(value)


COMMANDS: dict[
    str, tuple[str, Callable[[str, Any], Act]]
] = {  # command -> (the event it appends, act maker)
    "create": ("SessionCreated", create_with),
    "start": ("SessionStarted", start_with),
    "record": ("TrajectoryRecorded", record_with),
    "reward": ("RewardPosted", reward_with),
    "complete": ("SessionSucceeded", complete_with),
    "fail": ("SessionFailed", fail_with),
    "cancel": ("SessionCancelled", cancel_with),
}


def refused(command: str, name: str, label: str, value: Any, **options: Any) -> Case:
    return Case(
        f"{command}-{name}-{label}", command, name, COMMANDS[command][1](name, value), **options
    )


def accepted(command: str, name: str, label: str, value: Any, expect: Any, **options: Any) -> Case:
    event = COMMANDS[command][0]
    column, column_expect = options.pop("column", None), options.pop("column_expect", None)
    stored = Stored(
        options.pop("event", event), options.pop("stored_name", name), expect, column, column_expect
    )
    return Case(
        f"{command}-{name}-{label}-accepted",
        command,
        name,
        COMMANDS[command][1](name, value),
        stored=stored,
        **options,
    )


def generated_cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    # ---- create_session: identity, labels, metadata; attempt/timeout_s of its SessionStarted
    session_id = column_spec("events.session_id")
    for label, value in bad_texts(Field(minimum=1), session_id):
        add(refused("create", "session_id", label, value))
    for label, value in good_texts(Field(), session_id):
        if value is not None:
            add(accepted("create", "session_id", label, value, value))
    for name in ("run", "uid", "data_source", "runner", "partition"):
        declared, spec = _field("SessionCreated", name)
        if declared.choices is not None:
            for label, value in [
                ("other-case", str(declared.choices[0]).upper()),
                ("unknown", "test"),
                ("empty", ""),
                ("none", None),
                ("int", 1),
            ]:
                add(refused("create", name, label, value))
            for choice in declared.choices:
                add(accepted("create", name, choice, choice, choice))
            continue
        for label, value in bad_texts(declared, spec, none_is_default=name == "run"):
            add(refused("create", name, label, value))
        for label, value in good_texts(declared, spec):
            if not (name == "run" and value is None):  # run=None is the ledger's default run
                add(accepted("create", name, label, value, value))
    for name in ("session_index", "group_size", "global_step", "sample_index"):
        declared, spec = _field("SessionCreated", name)
        for label, value in bad_ints(declared, spec):
            add(refused("create", name, label, value))
    add(accepted("create", "session_index", "zero", 0, 0))
    add(accepted("create", "session_index", "numpy-int64", np.int64(0), 0))
    low_high = {
        "group_size": (1, 2**31 - 1),
        "global_step": (0, 2**63 - 1),
        "sample_index": (0, 2**63 - 1),
    }
    for name, (low, high) in low_high.items():
        for label, value in (("minimum", low), ("column-maximum", high)):
            add(accepted("create", name, label, value, value))
    add(accepted("create", "global_step", "none", None, None))
    add(accepted("create", "sample_index", "none", None, None))
    for name in ("group_size", "global_step"):
        add(accepted("create", name, "numpy-int64", np.int64(2), 2))
    add(accepted("create", "sample_index", "numpy-int64", np.int64(2), 2))
    for label, value in bad_json(mapping_only=False):
        add(refused("create", "metadata", label, value))
    for label, value in [*good_json(string_keys_only=False), ("none", None)]:
        add(
            accepted(
                "create", "metadata", label, value, {} if value is None else escaped_json(value)
            )
        )
    # attempt / timeout_s: given to create_session (its SessionStarted) and to start()
    attempt, attempt_spec = _field("SessionStarted", "attempt")
    timeout, _ = _field("SessionStarted", "timeout_s")
    for command in ("create", "start"):
        options = {"event": "SessionStarted"} if command == "create" else {}
        for label, value in bad_ints(attempt, attempt_spec):
            add(refused(command, "attempt", label, value))
        for label, value, _bug in bad_numbers(timeout):
            add(refused(command, "timeout_s", label, value))
        for label, value in (("minimum", 1), ("column-maximum", 2**31 - 1), ("none", None)):
            add(accepted(command, "attempt", label, value, value, **options))
        add(accepted(command, "attempt", "numpy-int64", np.int64(2), 2, **options))
        for label, value in (
            ("tiny", 5e-324),
            ("int", 5),
            ("numpy-float64", np.float64(1.5)),
            ("huge", 1e300),
            ("none", None),
        ):
            add(
                accepted(
                    command,
                    "timeout_s",
                    label,
                    value,
                    None if value is None else float(value),
                    **options,
                )
            )
    # ---- record_trajectory
    for name in ("prompt_ids", "response_ids"):
        for label, value in BAD_IDS:
            add(refused("record", name, label, value))
        for label, value, ids in GOOD_IDS:
            add(
                accepted(
                    "record",
                    name,
                    label,
                    value,
                    ids,
                    event="arrays",
                    stored_name="prompt_ids" if name == "prompt_ids" else "response_ids",
                )
            )
    for label, value in BAD_MASKS:
        add(refused("record", "response_mask", label, value))
    for label, value, mask in GOOD_MASKS:
        add(accepted("record", "response_mask", label, value, mask, event="arrays"))
    for label, value in BAD_LOGPROBS:
        add(refused("record", "response_logprobs", label, value))
    for label, value, logprobs in GOOD_LOGPROBS:
        add(
            accepted(
                "record",
                "response_logprobs",
                label,
                value,
                logprobs,
                event="arrays",
                stored_name="logprobs",
            )
        )
    declared, spec = _field("TrajectoryRecorded", "num_turns")
    for label, value in bad_ints(declared, spec):
        add(refused("record", "num_turns", label, value))
    for label, value in (("zero", 0), ("column-maximum", 2**31 - 1)):
        add(accepted("record", "num_turns", label, value, value))
    add(accepted("record", "num_turns", "numpy-int64", np.int64(2), 2))
    declared, spec = _field("TrajectoryRecorded", "materialization_reason")
    for label, value in bad_texts(declared, spec):
        add(refused("record", "materialization_reason", label, value))
    for label, value in [*good_texts(declared, spec), ("empty", "")]:
        add(accepted("record", "materialization_reason", label, value, value))
    for name in ("min_version", "max_version"):  # weights versions: an integer >= 0, or None
        for label, value in (("negative", -1), ("float", 1.5), ("text", "3"), ("bool", True)):
            add(refused("record", name, label, value))
        for label, value in (("zero", 0), ("none", None), ("numpy-int64", np.int64(7))):
            add(accepted("record", name, label, value, None if value is None else int(value)))
    for label, value in bad_json(mapping_only=False):
        add(refused("record", "extra", label, value))
    for label, value in good_json(string_keys_only=False):
        add(accepted("record", "extra", label, value, escaped_json(value)))
    # ---- post_reward
    for label, value, bug in bad_numbers(None):
        add(refused("reward", "reward", label, value, bug=bug))
    for label, value, bug in [*good_numbers(), ("none", None, None)]:
        number = None if value is None else float(value)
        add(
            accepted(
                "reward",
                "reward",
                label,
                value,
                number,
                column="reward",
                column_expect=number,
                bug=bug,
            )
        )
    for label, value in bad_json(mapping_only=True):
        add(refused("reward", "info", label, value))
    for label, value in good_json(string_keys_only=True):
        info = escaped_json(value)
        add(
            accepted(
                "reward",
                "info",
                label,
                value,
                info,
                column="reward_info",
                column_expect={**info, "reward": 0.5},
            )
        )
    # ---- complete (after one recorded trajectory)
    for label, value, bug in bad_numbers(None):
        add(refused("complete", "score", label, value, bug=bug, follow_up="complete"))
    for label, value, bug in [*good_numbers(), ("none", None, None)]:
        number = None if value is None else float(value)
        add(
            accepted(
                "complete",
                "score",
                label,
                value,
                number,
                column="reward",
                column_expect=number,
                bug=bug,
            )
        )
    for label, value in (("unknown", "best"), ("other-case", "ALL"), ("int", 1), ("list", ["all"])):
        add(refused("complete", "trajectory_selection", label, value, follow_up="complete"))
    for choice in DECLARATION["SessionSucceeded"]["trajectory_selection"].choices or ():
        add(accepted("complete", "trajectory_selection", choice, choice, choice))
    # ---- fail
    for label, value in (
        ("not-a-name", "bad luck"),
        ("other-case", "RUNNER_ERROR"),
        ("empty", ""),
        ("none", None),
        ("int", 1),
        ("the-projector's", "unprojectable"),
        ("an-origin", "infra"),
        ("33-chars", "x" * 33),
    ):
        add(refused("fail", "reason", label, value))
    for reason in (*ev.FAILURE_REASONS, "tool_quota"):  # built-in, or a custom lowercase name
        add(
            accepted(
                "fail",
                "reason",
                reason,
                reason,
                reason,
                column="failure_reason",
                column_expect=reason,
            )
        )
    for label, value in (("unknown", "model"), ("other-case", "INFRA"), ("empty", ""), ("int", 1)):
        add(refused("fail", "origin", label, value))
    for label, value, expect in (
        ("infra", "infra", "infra"),
        ("policy", "policy", "policy"),
        ("none", None, "policy"),
    ):
        add(
            accepted(
                "fail",
                "origin",
                label,
                value,
                expect,
                column="failure_origin",
                column_expect=expect,
            )
        )
    for name, spec in (
        ("message", column_spec("sessions.message")),
        ("error_type", column_spec("sessions.error_type")),
    ):
        assert spec.max_length is not None
        for label, value in free_texts(spec.max_length):
            expect = escaped(value, spec.max_length)
            add(accepted("fail", name, label, value, expect, column=name, column_expect=expect))
        for label, value, poisons in NOT_TEXT_VALUES:
            add(refused("fail", name, label, value, own_database=poisons))
    add(accepted("fail", "error_type", "none", None, None, column="error_type", column_expect=None))
    for label, value in (
        ("unknown", "session_budget"),
        ("other-case", "GROUP_BUDGET"),
        ("int", 1),
        ("array", np.array([1.5, 2.5])),  # compared to each budget, it has no truth value
    ):
        add(refused("fail", "retry_refused", label, value))
    for label, value in (("group", "group_budget"), ("step", "step_budget"), ("none", None)):
        add(accepted("fail", "retry_refused", label, value, value))
    # ---- cancel
    spec = column_spec("sessions.message")
    assert spec.max_length is not None
    for label, value in [*free_texts(spec.max_length), ("none", None), ("empty", "")]:
        expect = (
            None if value is None else escaped(value, spec.max_length) or None
        )  # an empty message is no message
        add(
            accepted(
                "cancel", "message", label, value, expect, column="message", column_expect=expect
            )
        )
    for label, value, poisons in NOT_TEXT_VALUES:
        add(refused("cancel", "message", label, value, own_database=poisons))
    return cases


# ------------------------------------------------------------------------------ written by hand
async def _sibling(ledger: Ledger, sid: str, _handle: Any, ctx: dict[str, Any]) -> None:
    """A group of two with its index 0 taken (by another session)."""
    ctx["identity"] = kw(group_size=2)
    sibling = fresh_id("sibling")
    ctx["sessions"].append(sibling)
    handle = await ledger.create_session(sibling, **ctx["identity"])
    await handle.record_trajectory(**GOOD)
    await handle.complete()
    ctx["identity"] = {
        **ctx["identity"],
        "session_index": 1,
    }  # the free slot: what the follow-up takes


def _in_group(**overrides: Any) -> Act:
    return lambda ledger, sid, _handle, ctx: ledger.create_session(
        sid, **{**ctx["identity"], **overrides}
    )


async def _duplicate(ledger: Ledger, sid: str, _handle: Any, ctx: dict[str, Any]) -> None:
    await ledger.create_session(sid, **kw())


def _setup_records(count: int, tokens: int) -> Act:
    async def setup(_ledger: Ledger, _sid: str, handle: Any, _ctx: dict[str, Any]) -> None:
        for _ in range(count):
            await handle.record_trajectory(prompt_ids=[1], response_ids=list(range(1, tokens + 1)))

    return setup


def _recorder_identity(overrides: dict[str, Any]) -> Act:
    async def act(ledger: Ledger, sid: str, _handle: Any, _ctx: dict[str, Any]) -> None:
        kwargs = kw(**{"group_size": 4, **overrides})
        await ledger.create_session(kwargs.pop("session_id", sid), **kwargs)

    return act


HAND_CASES: list[Case] = [
    Case(
        "create-session_index-taken-in-its-group",
        "create",
        "session_index",
        _in_group(session_index=0),
        setup=_sibling,
        mentions=("is taken in this group",),
    ),
    Case(
        "create-group_size-differs-from-its-group",
        "create",
        "group_size",
        _in_group(group_size=3),
        setup=_sibling,
        mentions=("of this group declared 2",),
    ),
    Case(
        "create-session_index-equals-group_size",
        "create",
        "session_index",
        create_with("session_index", 1),
    ),
    Case(
        "record-prompt_ids-1e20-named-as-given",
        "record",
        "prompt_ids",
        record_with("prompt_ids", [1e20, 2.0]),
        mentions=("outside [0, 2**31)",),
        not_mentioned=(str(-(2**63)),),
    ),
    Case(
        "create-duplicate-session_id",
        "record",
        "session_id",
        _duplicate,
        mentions=("already exists",),
    ),
    *(
        Case(
            f"recorder-identity-{name}-{_label(next(iter(o.values())))}",
            "create",
            name,
            _recorder_identity(o),
        )
        for name, o in BAD_IDENTITIES
    ),
    *(
        Case(
            f"recorder-trajectory-{name}-{_label(next(iter(o.values())))}",
            "record",
            name,
            lambda _l, _s, h, _c, o=o: h.record_trajectory(**{**GOOD, **o}),
        )
        for name, o in BAD_TRAJECTORIES
    ),
    # size caps (CAPS): per event, then per session
    Case(
        "cap-event-trajectory-tokens",
        "record",
        "trajectory",
        record_with("response_ids", list(range(1, 5001))),
        capped=True,
        mentions=("max_event_bytes=16,384", "TrajectoryRecorded", "token payload"),
    ),
    Case(
        "cap-event-trajectory-extra",
        "record",
        "trajectory",
        record_with("extra", {"blob": BLOB}),
        capped=True,
        mentions=("max_event_bytes=16,384",),
    ),
    Case(
        "cap-event-metadata",
        "create",
        "metadata",
        create_with("metadata", {"blob": BLOB}),
        capped=True,
        mentions=("max_event_bytes=16,384", "SessionCreated"),
    ),
    Case(
        "cap-event-reward-info",
        "reward",
        "info",
        reward_with("info", {"blob": BLOB}),
        capped=True,
        mentions=("max_event_bytes=16,384", "RewardPosted"),
    ),
    Case(
        "cap-session-events",
        "record",
        "trajectory",
        record_with("num_turns", 1),
        setup=_setup_records(6, 2),
        capped=True,
        mentions=("max_session_events=8", "has 8 events"),
        follow_up="complete",
    ),
    Case(
        "cap-session-events-reward",
        "reward",
        "info",
        reward_with("reward", 0.5),
        setup=_setup_records(6, 2),
        capped=True,
        mentions=("max_session_events=8",),
        follow_up="complete",
    ),
    Case(
        "cap-session-bytes",
        "record",
        "trajectory",
        record_with("response_ids", list(range(1, 2501))),
        setup=_setup_records(3, 2500),
        capped=True,
        mentions=("max_session_bytes=49,152",),
        follow_up="complete",
    ),
]

CASES = [*generated_cases(), *HAND_CASES]
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def test_every_argument_of_every_command_has_cases() -> None:
    """The matrix covers each keyword of each command (read from the signatures), refused and, for
    fields that store what they are given, accepted too."""
    signatures = {
        "create": Ledger.create_session,
        "start": SessionHandle.start,
        "record": SessionHandle.record_trajectory,
        "reward": SessionHandle.post_reward,
        "complete": SessionHandle.complete,
        "fail": SessionHandle.fail,
        "cancel": SessionHandle.cancel,
    }
    for command, function in signatures.items():
        parameters = {
            name for name in inspect.signature(function).parameters if name not in ("self", "start")
        }
        covered = {c.field for c in CASES if c.command == command}
        assert parameters <= covered, f"{command}: no case for {sorted(parameters - covered)}"
        for name in parameters:
            kinds = {c.stored is None for c in CASES if c.command == command and c.field == name}
            assert kinds == {True, False}, (
                f"{command}({name}=…) needs refused and accepted cases: {kinds}"
            )


# ------------------------------------------------------------------------------ running a case
@dataclass
class MatrixDatabase:
    """The module's database (per backend) for the matrix: a ledger, one with the size caps beside
    it, and which case wrote which session (so the closing audit can name a case)."""

    ledger: Ledger
    capped: Ledger
    backend: str
    owners: dict[str, str] = field(default_factory=dict)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def matrix(module_db_url: str) -> AsyncIterator[MatrixDatabase]:
    await wipe(module_db_url)
    async with Ledger.open(module_db_url) as opened:
        capped = Ledger(opened.engine, limits=Limits(**CAPS))
        try:
            yield MatrixDatabase(opened, capped, backend_of(module_db_url))
        finally:
            await capped.close()


async def event_count(ledger: Ledger) -> int:
    async with ledger.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(events))).scalar_one())


async def quarantined(ledger: Ledger, session_ids: list[str]) -> list[Any]:
    async with ledger.engine.connect() as conn:
        rows = await conn.execute(
            select(projection_errors).where(projection_errors.c.session_id.in_(session_ids))
        )
        return [tuple(r) for r in rows]


async def session_column(ledger: Ledger, sid: str, column: str) -> Any:
    async with ledger.engine.connect() as conn:
        return (
            await conn.execute(
                select(sessions_table.c[column]).where(sessions_table.c.session_id == sid)
            )
        ).scalar_one()


async def stored_value(ledger: Ledger, sid: str, stored: Stored) -> Any:
    """What the log holds: the event's data as stored, or its decoded token arrays."""
    stream = await ledger.store.read_stream(sid)
    if stored.event == "arrays":
        trajectory = [ev.decode(s).event for s in stream if s.type == "TrajectoryRecorded"][-1]
        values = getattr(trajectory.arrays(), stored.name)  # type: ignore[attr-defined]
        return None if values is None else values.tolist()
    matching = [s for s in stream if s.type == stored.event]
    assert matching, f"no {stored.event} in {[s.type for s in stream]}"
    return matching[-1].data[stored.name]


async def finish(handle: SessionHandle) -> None:
    """End a session that is still open: one trajectory (if it has none) and complete()."""
    if handle.terminal:
        return
    if handle.state == "created":
        await handle.start()
    if not handle.view.trajectories:
        await handle.record_trajectory(**GOOD)
    assert await handle.complete() == "succeeded"


async def run_case(
    plain: Ledger, capped: Ledger, case: Case, *, audit_now: bool = True
) -> list[str]:
    """Run one case; returns the sessions it wrote. `audit_now=False` leaves the audit to the
    caller (the matrix audits its shared database once, naming the case of any divergence)."""
    ledger = capped if case.capped else plain
    sid = fresh_id()
    ctx: dict[str, Any] = {"sessions": [sid]}
    handle: SessionHandle | None = None
    if case.command != "create":
        handle = await ledger.create_session(sid, **kw(), start=case.command != "start")
        if case.command == "complete":
            await handle.record_trajectory(**GOOD)
    if case.setup is not None:
        await case.setup(ledger, sid, handle, ctx)
    before = await event_count(ledger)
    version, state = (handle.version, handle.state) if handle is not None else (None, None)
    error: InvalidInput | None = None
    if case.stored is None:
        with pytest.raises(InvalidInput) as caught:
            await case.act(ledger, sid, handle, ctx)
        error = caught.value
        assert isinstance(error, ValueError)
        assert error.field == case.field, f"{case.id}: field {error.field!r}: {error}"
        message = str(error)
        if error.session_id:
            assert message.startswith(f"session {sid!r}: {case.field}:"), message
        assert case.field in message
        if case.field != "session_id":
            assert sid in message, f"{case.id}: the session is not named: {message}"
        for needle in case.mentions:
            assert needle in message, f"{case.id}: {needle!r} not in {message!r}"
        for needle in case.not_mentioned:
            if needle in message:
                raise WrongMessage(f"{case.id}: {needle!r} in {message!r}")
        assert await event_count(ledger) == before, f"{case.id}: something was written"
        # still usable
        if handle is None:
            if case.field != "session_id":
                with pytest.raises(InvalidInput, match="no such session"):
                    await ledger.load_session(sid)  # the refused creation left nothing behind
            else:
                sid = ctx["sessions"][0] = fresh_id()
            handle = await ledger.create_session(sid, **ctx.get("identity", kw()))
        else:
            assert (handle.version, handle.state) == (version, state), (
                f"{case.id}: the handle moved"
            )
            assert await ledger.store.stream_version(sid) == version
            if case.id.startswith("cap-"):
                assert error.limit_name in message and error.size > error.limit  # type: ignore[attr-defined]
        if case.follow_up == "complete":
            assert await handle.complete() == "succeeded"  # a session at its cap can always end
        await finish(handle)
    else:
        result = await case.act(ledger, sid, handle, ctx)
        if handle is None:
            handle = result
            sid = ctx["sessions"][0] = handle.session_id
        assert await event_count(ledger) > before, f"{case.id}: nothing was appended"
        if case.field == "session_id":
            assert [e.session_id for e in await ledger.store.read_stream(sid)][:1] == [
                case.stored.expect
            ]
        else:
            assert same(await stored_value(ledger, sid, case.stored), case.stored.expect), (
                case.stored
            )
        await finish(handle)
    # the projector takes what was accepted, and audit agrees
    await ledger.project()
    assert await quarantined(ledger, ctx["sessions"]) == [], (
        f"{case.id}: the projector quarantined an accepted event"
    )
    if case.stored is not None and case.stored.column is not None:
        assert same(
            await session_column(ledger, sid, case.stored.column), case.stored.column_expect
        ), case.stored
    if audit_now:
        report = await audit(ledger.engine)
        assert report.ok and not report.quarantined, report.divergences[:3]
    if error is not None and case.field != "session_id" and error.session_id != sid:
        raise SessionNotNamed(
            f"{case.id}: InvalidInput.session_id is {error.session_id!r}, not {sid!r}"
        )
    return ctx["sessions"]


def same(found: Any, expected: Any) -> bool:
    """Equal, a number compared as the float it stands for: PostgreSQL's jsonb gives an integral
    float back as an int (1e300 as 10**300), which is the same double once read as a float."""
    if (
        isinstance(found, (int, float))
        and not isinstance(found, bool)
        and isinstance(expected, float)
    ):
        return float(found) == expected
    return bool(found == expected)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", [c for c in CASES if not c.own_database], ids=lambda c: c.id)
async def test_bad_input_matrix(matrix: MatrixDatabase, case: Case) -> None:
    with known_bug(case.bug, matrix.backend):
        written = await run_case(matrix.ledger, matrix.capped, case, audit_now=False)
    matrix.owners.update(dict.fromkeys(written, case.id))


@pytest.mark.asyncio(loop_scope="module")
async def test_the_matrix_database_audits_clean(matrix: MatrixDatabase) -> None:
    """The audit of every case above, at once (one audit per case would rebuild the whole shared
    log each time): a replay of the log equals what the projector stored, nothing is quarantined,
    and a divergence is reported with the case that wrote its session."""
    await matrix.ledger.project()
    report = await audit(matrix.ledger.engine)
    named = [(matrix.owners.get(d.session_id or "", "?"), str(d)) for d in report.divergences]
    assert report.ok and not report.quarantined, named[:5]
    assert report.sessions >= len(matrix.owners)


@pytest.mark.parametrize("case", [c for c in CASES if c.own_database], ids=lambda c: c.id)
async def test_bad_input_matrix_on_a_database_of_its_own(db_url: str, case: Case) -> None:
    """Cases a known bug lets into the log as a value the projector cannot project."""
    async with Ledger.open(db_url) as ledger:
        with known_bug(case.bug, backend_of(db_url)):
            await run_case(ledger, Ledger(ledger.engine, limits=Limits(**CAPS)), case)


@pytest.mark.parametrize("command", ["fail-message", "fail-error_type", "cancel-message"])
async def test_a_non_text_message_never_stops_the_projector(db_url: str, command: str) -> None:
    """Whatever a command does with a list where text belongs, projection must go on for the other
    sessions (docs/design.md §4: nothing is appended that the projector cannot project)."""
    async with Ledger.open(db_url) as ledger:
        bad = await ledger.create_session(fresh_id(), **kw())
        with contextlib.suppress(InvalidInput):
            if command == "cancel-message":
                await bad.cancel(["not", "text"])  # type: ignore[arg-type]
            else:
                await bad.fail("runner_error", **{command.removeprefix("fail-"): ["not", "text"]})
        good = await ledger.create_session(fresh_id("good"), **kw())
        await finish(good)
        await ledger.project()
        assert await session_column(ledger, good.session_id, "state") == "succeeded"


async def test_rewards_whose_sum_overflows_never_stop_the_projector(db_url: str) -> None:
    """Each reward is finite, so each is accepted; what the projector derives from them must then be
    storable too (docs/design.md §4): projection goes on and no metric is NaN. Two groups of three rewards of
    +-1.7e308 (each group's sum past the float range): a group's mean stays in range (saturated at
    +-float max), so the groups' means add up without ever meeting as inf - inf; a sum of rows past
    the range is stored as +inf (both backends store infinities), and so is the mean derived from it."""
    async with Ledger.open(db_url) as ledger:
        for sign in (1.0, -1.0):
            identity = kw(group_size=3)
            for index in range(3):
                async with ledger.session(fresh_id(), **{**identity, "session_index": index}) as s:
                    await s.record_trajectory(**GOOD)
                    await s.post_reward(sign * 1.7e308)
        await ledger.project()
        async with ledger.engine.connect() as conn:
            values = {
                r.metric: r.value
                for r in await conn.execute(
                    text("SELECT metric, value FROM metric_counts WHERE data_source IS NULL")
                )
            }
            means = [
                r.reward_sum / r.reward_count
                for r in await conn.execute(text("SELECT reward_sum, reward_count FROM groups"))
            ]
    nan = sorted(name for name, value in values.items() if value is None or math.isnan(value))
    assert nan == [], f"NaN metrics: {nan}"
    assert sorted(means) == [-math.inf, math.inf]  # the groups' own sums left the float range
    assert (
        values["reward/uids@3"] == 2 and values["reward/mean@3"] == 0.0
    )  # +max and -max: finite means
    assert values["reward/mean_per_uid"] == 0.0 and values["reward/uids_excluded"] == 0
    assert (
        values["reward/sum"] == math.inf and values["reward/mean"] == math.inf
    )  # +,+,+ then -,-,-: inf stays inf


# ------------------------------------------------------------------------------ caps, beyond one command
@pytest.fixture
async def capped_ledger(module_db_url: str) -> AsyncIterator[Ledger]:
    async with Ledger.open(module_db_url, **CAPS) as opened:
        yield opened


async def test_a_cap_breach_inside_a_session_fails_it_as_invalid_output(
    capped_ledger: Ledger,
) -> None:
    sid = fresh_id("capped")
    with pytest.raises(InvalidInput, match="max_event_bytes"):
        async with capped_ledger.session(sid, **kw()) as s:
            await s.record_trajectory(prompt_ids=[1], response_ids=list(range(1, 5001)))
    stored = await capped_ledger.store.read_stream(sid)
    assert [e.type for e in stored] == [
        "SessionCreated",
        "SessionStarted",
        "SessionFailed",
        "PlaceholderEmitted",
    ]
    assert (
        stored[2].data["reason"] == "invalid_output"
        and "max_event_bytes" in stored[2].data["message"]
    )


async def test_caps_count_what_is_already_stored_when_a_session_is_reloaded(
    capped_ledger: Ledger,
) -> None:
    sid = fresh_id("reload")
    handle = await capped_ledger.create_session(sid, **kw())
    await _setup_records(3, 2500)(capped_ledger, sid, handle, {})
    reloaded = await capped_ledger.load_session(sid)
    with pytest.raises(InvalidInput, match="max_session_bytes"):
        await reloaded.record_trajectory(prompt_ids=[1], response_ids=list(range(1, 2501)))
    await reloaded.fail("runner_error", message="gave up")  # terminal commands are never capped
    assert reloaded.state == "failed"


def test_cap_defaults_and_validation() -> None:
    assert Limits() == Limits(MAX_EVENT_BYTES, MAX_SESSION_EVENTS, MAX_SESSION_BYTES)
    assert (MAX_EVENT_BYTES, MAX_SESSION_EVENTS, MAX_SESSION_BYTES) == (
        8 * 2**20,
        51_200,
        128 * 2**20,
    )
    Limits(None, None, None)  # no caps at all
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_event_bytes"):
            Limits(max_event_bytes=bad)  # type: ignore[arg-type]


async def test_ledger_open_validates_caps(sqlite_url: str) -> None:
    with pytest.raises(ValueError, match="max_session_events"):
        async with Ledger.open(sqlite_url, max_session_events=0):
            pass
    async with Ledger.open(sqlite_url, max_event_bytes=None) as ledger:
        assert (
            ledger.limits.max_event_bytes is None
            and ledger.limits.max_session_events == MAX_SESSION_EVENTS
        )


# ------------------------------------------------------------------------------ a damaged log


async def _two_sessions(ledger: Ledger) -> int:
    """`ok` (projected) then `hit` (not yet projected); returns the checkpoint after `ok`."""
    async with ledger.session("ok", **kw(uid="uok")) as s:
        await s.record_trajectory(**GOOD)
        await s.post_reward(1.0)
    await ledger.project()
    checkpoint = await ledger.store.last_position()
    async with ledger.session("hit", **kw(uid="uhit")) as s:
        await s.record_trajectory(**GOOD)
        await s.post_reward(0.5)
    return checkpoint


async def _checkpoint(ledger: Ledger) -> int:
    async with ledger.engine.connect() as conn:
        return int((await conn.execute(text("SELECT position FROM checkpoints"))).scalar_one())


async def _errors(ledger: Ledger) -> list[tuple[Any, ...]]:
    async with ledger.engine.connect() as conn:
        rows = await conn.execute(select(projection_errors).order_by(projection_errors.c.position))
        return [(r.position, r.session_id, r.type, r.field, r.outcome, r.reason) for r in rows]


async def _projection_quarantines(
    ledger: Ledger, position: int, type_: str, outcome: str, *needles: str
) -> None:
    """`project()` goes past the event at `position`: it is listed, and the log is projected to its end."""
    await ledger.project()
    errors = await _errors(ledger)
    assert [e[:5] for e in errors] == [(position, "hit", type_, None, outcome)], errors
    for needle in needles:
        assert needle in errors[0][5], (needle, errors[0][5])
    assert await _checkpoint(ledger) == await ledger.store.last_position()
    report = await audit(ledger.engine)  # listed by audit too, as a divergence at that position
    assert [(q["position"], q["type"], q["outcome"]) for q in report.quarantined] == [
        (position, type_, outcome)
    ]
    assert any(
        d.table == "events" and d.key == f"position {position}" for d in report.divergences
    ), report.divergences


async def test_malformed_json_in_a_stored_event(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        checkpoint = await _two_sessions(ledger)
        tamper = text(
            "UPDATE events SET data = '{\"reward\": 0.5, ' WHERE session_id = 'hit' AND type = 'RewardPosted'"
        )
        if ledger.engine.dialect.name == "postgresql":
            with pytest.raises(
                DBAPIError, match="json"
            ):  # JSONB refuses it: the log cannot hold it
                async with ledger.engine.begin() as conn:
                    await conn.execute(tamper)
            assert (await audit(ledger.engine)).ok
            return
        async with ledger.engine.begin() as conn:
            await conn.execute(tamper)
            position = (
                await conn.execute(
                    text(
                        "SELECT position FROM events WHERE session_id = 'hit' AND type = 'RewardPosted'"
                    )
                )
            ).scalar_one()
        with pytest.raises(
            StoredJSONError, match="session 'hit': stored JSON is malformed"
        ) as caught:
            await ledger.load_session("hit")
        assert "rollout-ledger audit" in str(caught.value) and isinstance(caught.value, ValueError)
        report = await audit(
            ledger.engine
        )  # reported, not raised: the malformed row and its quarantine
        assert {(d.table, d.session_id, d.field) for d in report.divergences} == {
            ("events", "hit", "data"),
            ("events", "hit", "RewardPosted"),
        }
        assert all("stored JSON is malformed" in str(d.found) for d in report.divergences)
        assert await _checkpoint(ledger) == checkpoint
        await _projection_quarantines(
            ledger, position, "RewardPosted", "session_failed", "stored JSON is malformed"
        )


async def test_audit_reports_malformed_json_as_a_divergence(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        await _two_sessions(ledger)
        async with ledger.engine.begin() as conn:
            await conn.execute(
                text(
                    "UPDATE events SET data = '{' WHERE session_id = 'hit' AND type = 'RewardPosted'"
                )
            )
            position = (
                await conn.execute(
                    text(
                        "SELECT position FROM events WHERE session_id = 'hit' AND type = 'RewardPosted'"
                    )
                )
            ).scalar_one()
        report = await audit(ledger.engine)
        assert not report.ok and report.divergences[0].session_id == "hit"
        first = report.divergences[0]
        assert (first.field, first.position, first.expected) == ("data", position, "valid JSON")
        assert [(q["position"], q["outcome"]) for q in report.quarantined] == [
            (position, "session_failed")
        ]
        assert (
            report.events == 11 and report.sessions == 2
        )  # the whole log was still checked (the run's RunConfigured too)


async def _insert(ledger: Ledger, type_: str, schema_version: int, data: dict[str, Any]) -> int:
    async with ledger.engine.begin() as conn:
        result = await conn.execute(
            insert(events).values(
                event_id=str(uuid.uuid4()),
                session_id="hit",
                version=6,
                type=type_,
                schema_version=schema_version,
                run="default",
                uid="uhit",
                partition="val",
                global_step=0,
                data=data,
                payload=None,
                recorded_at=datetime.now(timezone.utc),
            )
        )
        return int(result.inserted_primary_key[0])


@pytest.mark.parametrize(
    ("type_", "schema_version", "needles"),
    [
        ("SessionPaused", 1, ("unknown event type 'SessionPaused'", "upgrade")),
        ("RewardPosted", 7, ("'RewardPosted' has schema_version 7", "newer than this library's 1")),
    ],
    ids=["type-from-the-future", "schema-version-from-the-future"],
)
async def test_an_event_from_the_future_is_a_clear_error_and_quarantined(
    db_url: str, type_: str, schema_version: int, needles: tuple[str, ...]
) -> None:
    async with Ledger.open(db_url) as ledger:
        await _two_sessions(ledger)
        position = await _insert(
            ledger, type_, schema_version, {"note": "from a newer rollout-ledger"}
        )
        with pytest.raises(UnknownEventError) as caught:  # reading the stream stays a clear error
            await ledger.load_session("hit")
        for needle in needles:
            assert needle in str(caught.value)
        # projection goes past it (docs/design.md §7); "hit" had already succeeded, so the event is only listed
        await _projection_quarantines(ledger, position, type_, "ignored", *needles)
        assert await session_column(ledger, "hit", "state") == "succeeded"
        # the rest of the log is intact
        cw.check_streams(
            {sid: s for sid, s in (await cw.log_streams(ledger.engine)).items() if sid != "hit"}
        )


async def _empty_reward_data(ledger: Ledger, session_id: str) -> int:
    """Replace a session's RewardPosted data with `{}` (valid JSON, wrong shape); its position."""
    async with ledger.engine.begin() as conn:
        where = (events.c.session_id == session_id, events.c.type == "RewardPosted")
        await conn.execute(update(events).where(*where).values(data={}))
        return (await conn.execute(select(events.c.position).where(*where))).scalar_one()


async def test_event_data_of_the_wrong_shape_names_its_position(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        await _two_sessions(ledger)
        position = await _empty_reward_data(ledger, "hit")
        needles = (f"event at position {position}", "RewardPosted", "malformed data")
        with pytest.raises(UnknownEventError) as caught:
            await ledger.load_session("hit")
        assert all(n in str(caught.value) for n in needles), str(caught.value)
        # quarantined while "hit" was still running: failed as unprojectable, its placeholder in the batch
        await _projection_quarantines(ledger, position, "RewardPosted", "session_failed", *needles)
        assert await session_column(ledger, "hit", "failure_reason") == "unprojectable"
        batch = await ledger.batch("val", 0, timeout=10)
        assert batch["is_placeholder"].tolist().count(True) == 1
        # within the projected part of the log, audit's replay reports it
        await _empty_reward_data(ledger, "ok")
        report = await audit(ledger.engine)
        assert not report.ok and "malformed data" in str(report.divergences[0])


async def test_audit_flags_data_of_the_wrong_shape_past_the_checkpoint(sqlite_url: str) -> None:
    async with Ledger.open(sqlite_url) as ledger:
        checkpoint = await _two_sessions(ledger)
        position = await _empty_reward_data(ledger, "hit")
        report = await audit(ledger.engine)
        assert position > checkpoint == report.projected_through
        # the log check names the field; the rules' quarantine names the event (table events, key position N)
        assert [(d.table, d.session_id, d.position, d.field) for d in report.divergences] == [
            ("events", "hit", position, "data"),
            ("events", "hit", position, "RewardPosted"),
        ]
        assert report.divergences[1].key == f"position {position}"
        assert "malformed data" in str(report.divergences[0]) and "reward" in str(
            report.divergences[0]
        )
        assert [(q["position"], q["type"], q["outcome"]) for q in report.quarantined] == [
            (position, "RewardPosted", "session_failed")
        ]
