"""Property (docs/design.md §4, §7): whatever a caller passes, a command either raises `InvalidInput` or is
accepted — and an accepted command projects without quarantine. Nothing in between: no other
exception from a command, no projector error, no `projection_errors` row for a value the recorder
let through.

Each example records one session: `create_session` with every keyword drawn, optionally
`start`, a few `record_trajectory` / `post_reward`, then `complete`, `fail`, `cancel` or nothing,
every argument drawn from a mix of well-typed values (integers of any size, floats with NaN and
infinities, text with NUL, lone surrogates, `_` and long runs, numpy and torch arrays of many
dtypes, nested dicts and lists) and arbitrary ones of any type. A refused command appends nothing
and the session goes on; a refused creation falls back to a valid one, so the later commands still
run. After the session, `project()` must succeed with the `projection_errors` table empty.

Both backends, one module-scoped database each, emptied per example with conftest's `wipe` (so a
failing example cannot leave the next one a poisoned log, and shrinking stays honest).

tests/domain/test_bad_input.py pins the same contract case by case; this property looks for what its
matrix did not think of.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from sqlalchemy import func, select

from sessions import InvalidInput, Ledger, storable
from sessions import events as ev
from sessions.failure_policy import EXCLUDE
from sessions.placeholder import EMIT, KEEP_PARTIAL
from sessions.projection.rules import LogEvent, Rules, WorkingSet
from sessions.storable import DECLARATION
from store import column_spec, create_engine
from store.schema.tables import events, projection_errors, queue_rows, sessions
from tests.conftest import backend_of, wipe

torch = pytest.importorskip("torch")

#: Examples per backend: an example costs ~0.1 s on SQLite and ~0.35 s on PostgreSQL (emptying the
#: database included), so the file stays near 25 s of the suite's 15-minute budget; every CI run
#: draws new examples (no example database is kept), so the runs add up.
EXAMPLES = {"sqlite": 100, "postgres": 40}


# ------------------------------------------------------------------------------ strategies
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=12)
SPECIAL_TEXT = st.sampled_from(
    ["", "_", "a_b", "\x00", "a\x00b", "\ud800", "x\udcffy", "é☃🙂", "x" * 65, "y" * 129, "z" * 600]
)
TEXT = st.one_of(ANY_TEXT, SPECIAL_TEXT, st.text(alphabet="ab_", min_size=120, max_size=700))
EDGE_INTS = st.sampled_from(
    [
        0,
        1,
        -1,
        2**31 - 1,
        2**31,
        -(2**31) - 1,
        2**63 - 1,
        2**63,
        -(2**63) - 1,
        10**30,
        10**400,
        -(10**400),
    ]
)
INTS = st.one_of(st.integers(), EDGE_INTS)
FLOATS = st.one_of(
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 1.7e308, -0.0, 5e-324])
)
NUMPY_SCALARS = st.one_of(
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(np.float32, st.floats(width=32)),
    st.builds(np.float64, st.floats()),
    st.builds(np.uint8, st.integers(0, 255)),
    st.just(np.bool_(True)),
)
LEAVES = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, TEXT, st.binary(max_size=4), NUMPY_SCALARS
)
ANYTHING = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.one_of(TEXT, INTS), children, max_size=3),
    ),
    max_leaves=8,
)
JSONISH = st.dictionaries(TEXT, ANYTHING, max_size=4)


def typed(typical: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly values of the field's type, sometimes anything at all."""
    return st.one_of(typical, typical, ANYTHING)


_NUMPY_DTYPES = st.sampled_from(
    ["<i1", "<u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", ">i4", "<f2", "<f4", "<f8", "?"]
)
_TORCH_DTYPES = st.sampled_from(
    [None, "bfloat16", "float16", "int8", "int16", "int32", "int64", "float64", "bool"]
)


@st.composite
def arrays(draw: st.DrawFn, *, length: int | None = None) -> Any:
    """A token/mask/logprob argument: a list, a numpy array or a torch tensor of any dtype, or not
    an array at all."""
    size = length if length is not None else draw(st.integers(0, 6))
    kind = draw(st.sampled_from(["ints", "floats", "numpy", "torch", "anything"]))
    if kind == "anything":
        return draw(ANYTHING)
    if kind == "ints":
        return draw(st.lists(st.one_of(st.integers(0, 50_000), INTS), min_size=size, max_size=size))
    if kind == "floats":
        return draw(st.lists(FLOATS, min_size=size, max_size=size))
    array = draw(hnp.arrays(draw(_NUMPY_DTYPES), size))
    if kind == "numpy":
        return array
    if array.dtype.byteorder == ">" or (
        array.dtype.kind == "u" and array.dtype.itemsize > 1
    ):  # torch has no such dtype
        array = array.astype(
            array.dtype.newbyteorder("=") if array.dtype.byteorder == ">" else np.int64
        )
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    dtype = draw(_TORCH_DTYPES)
    if dtype is not None:
        tensor = tensor.to(getattr(torch, dtype))
    if draw(st.booleans()) and tensor.numel():
        tensor = tensor.to("meta")
    return tensor


@dataclass
class Session:
    """One session's drawn commands."""

    create: dict[str, Any]
    start: dict[str, Any] | None  # None: created started; else start(**these) after start=False
    steps: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    end: tuple[str, dict[str, Any]] | None = None


# Storable values, at their edges: what a valid command may carry.
def _label(max_size: int, forbidden: str = "") -> st.SearchStrategy[str]:
    """A short label (id, uid, data source…): any characters but NUL, lone surrogates and `forbidden`,
    short or up to its column's length."""
    alphabet = st.characters(exclude_categories=("Cs",), exclude_characters="\x00" + forbidden)
    return st.one_of(
        st.text(alphabet, min_size=1, max_size=8),
        st.text(alphabet, min_size=max_size - 2, max_size=max_size),
    )


FINITE = st.floats(allow_nan=False, allow_infinity=False)
JSON_VALUE = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), FINITE, TEXT
    ),  # free text: NUL and surrogates are escaped
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(TEXT, children, max_size=3)
    ),
    max_leaves=8,
)
JSON_DICT = st.dictionaries(TEXT, JSON_VALUE, max_size=4)
MAYBE_JSON = st.one_of(st.none(), JSON_DICT)
NUMBER = st.one_of(
    FINITE,
    st.integers(-(2**1000), 2**1000),
    st.builds(np.float32, st.floats(width=32, allow_nan=False, allow_infinity=False)),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
)


@st.composite
def token_ids(draw: st.DrawFn) -> Any:
    ids = draw(
        st.lists(st.one_of(st.integers(0, 100), st.integers(0, 2**31 - 1)), min_size=1, max_size=6)
    )
    form = draw(st.sampled_from(["list", "numpy", "torch", "torch-bfloat16-small", "floats"]))
    if form == "numpy":
        return np.array(
            ids, dtype=draw(st.sampled_from(["<i4", "<i8", ">i8", "<u4", "<u8", "<f8"]))
        )
    if form == "torch":
        return torch.tensor(ids, dtype=torch.int64)
    if form == "torch-bfloat16-small":
        return torch.tensor([i % 256 for i in ids], dtype=torch.bfloat16)  # exact in bfloat16
    if form == "floats":
        return [float(i) for i in ids]
    return ids


def _length(value: Any) -> int:
    return int(value.shape[0]) if hasattr(value, "shape") else len(value)


@st.composite
def valid_trajectory(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_ids": draw(token_ids()), "response_ids": draw(token_ids())}
    n = _length(out["response_ids"])
    if draw(st.booleans()):
        mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        out["response_mask"] = draw(
            st.sampled_from(
                [
                    mask,
                    [bool(m) for m in mask],
                    [float(m) for m in mask],
                    torch.tensor(mask, dtype=torch.bool),
                    np.array(mask, dtype=np.uint8),
                ]
            )
        )
    if draw(st.booleans()):
        values = draw(st.lists(st.floats(-(2.0**100), 0.0, width=32), min_size=n, max_size=n))
        out["response_logprobs"] = draw(
            st.sampled_from(
                [
                    values,
                    np.array(values, dtype=np.float32),
                    torch.tensor(values, dtype=torch.bfloat16),
                ]
            )
        )
    for name, strategy in (
        ("num_turns", st.integers(0, 2**31 - 1)),
        ("materialization_reason", st.one_of(st.none(), _label(64))),
        ("extra", MAYBE_JSON),
    ):
        if draw(st.booleans()):
            out[name] = draw(strategy)
    return out


@st.composite
def odd_trajectory(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_ids": draw(arrays()), "response_ids": draw(arrays())}
    length = (
        len(out["response_ids"]) if isinstance(out["response_ids"], (list, np.ndarray)) else None
    )
    for name in ("response_mask", "response_logprobs"):
        how = draw(st.sampled_from(["absent", "like-response", "any"]))
        if how == "like-response" and length is not None:
            out[name] = draw(arrays(length=length))
        elif how == "any":
            out[name] = draw(arrays())
    for name, strategy in (
        ("num_turns", typed(INTS)),
        ("materialization_reason", typed(st.one_of(st.none(), TEXT))),
        ("extra", typed(st.one_of(st.none(), JSONISH))),
    ):
        if draw(st.booleans()):
            out[name] = draw(strategy)
    return out


Fields = dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any], bool]]


@st.composite
def arguments(draw: st.DrawFn, fields: Fields) -> dict[str, Any]:
    """A command's keywords: each field valid, but for up to two drawn odd; an optional field (third
    item True) may also be left out. (All odd at once would leave no command ever accepted.)"""
    odd = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
    out: dict[str, Any] = {}
    for name, (valid, strange, optional) in fields.items():
        if name in odd:
            out[name] = draw(strange)
        elif not optional or draw(st.booleans()):
            out[name] = draw(valid)
    return out


ODD_TEXT = typed(st.one_of(st.none(), TEXT))
ODD_INT = typed(st.one_of(st.none(), INTS))
ODD_NUMBER = typed(st.one_of(st.none(), FLOATS, INTS))
START_FIELDS: Fields = {
    "attempt": (st.one_of(st.none(), st.integers(1, 2**31 - 1)), ODD_INT, True),
    "timeout_s": (
        st.one_of(
            st.none(),
            st.floats(min_value=0.0, exclude_min=True, allow_infinity=False),
            st.integers(1, 2**40),
        ),
        ODD_NUMBER,
        True,
    ),
}


@st.composite
def session_commands(draw: st.DrawFn) -> Session:
    size = draw(st.one_of(st.integers(1, 4), st.integers(1, 2**31 - 1)))
    create = draw(
        arguments(
            {
                "session_id": (_label(128), typed(TEXT), False),
                "run": (_label(128), typed(TEXT), True),
                "uid": (_label(128, forbidden="_"), typed(TEXT), False),
                "session_index": (st.integers(0, size - 1), typed(INTS), False),
                "group_size": (st.just(size), typed(INTS), False),
                "partition": (st.sampled_from(["train", "val"]), typed(TEXT), False),
                "global_step": (st.one_of(st.none(), st.integers(0, 2**63 - 1)), ODD_INT, True),
                "data_source": (st.one_of(st.none(), _label(128)), ODD_TEXT, True),
                "runner": (st.one_of(st.none(), _label(128)), ODD_TEXT, True),
                "sample_index": (st.one_of(st.none(), st.integers(0, 2**63 - 1)), ODD_INT, True),
                "metadata": (MAYBE_JSON, typed(st.one_of(st.none(), JSONISH)), True),
                **START_FIELDS,
            }
        )
    )
    start = draw(arguments(START_FIELDS)) if draw(st.booleans()) else None
    steps: list[tuple[str, dict[str, Any]]] = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            steps.append(
                (
                    "record_trajectory",
                    draw(st.one_of(valid_trajectory(), valid_trajectory(), odd_trajectory())),
                )
            )
        else:
            steps.append(
                (
                    "post_reward",
                    draw(
                        arguments(
                            {
                                "reward": (st.one_of(st.none(), NUMBER), ODD_NUMBER, False),
                                "info": (JSON_DICT, JSONISH, False),
                            }
                        )
                    ),
                )
            )
    ending = draw(st.sampled_from(["complete", "fail", "cancel", None]))
    end: tuple[str, dict[str, Any]] | None = None
    if ending == "complete":
        end = (
            "complete",
            draw(
                arguments(
                    {
                        "score": (st.one_of(st.none(), NUMBER), ODD_NUMBER, True),
                        "trajectory_selection": (
                            st.sampled_from(["all", "longest"]),
                            typed(TEXT),
                            True,
                        ),
                    }
                )
            ),
        )
    elif ending == "fail":
        end = (
            "fail",
            draw(
                arguments(
                    {
                        "reason": (st.sampled_from(ev.FAILURE_REASONS), typed(TEXT), False),
                        "message": (TEXT, typed(TEXT), True),
                        "error_type": (st.one_of(st.none(), TEXT), ODD_TEXT, True),
                    }
                )
            ),
        )
    elif ending == "cancel":
        end = (
            "cancel",
            draw(arguments({"message": (st.one_of(st.none(), TEXT), ODD_TEXT, False)})),
        )
    return Session(create, start, steps, end)


# ------------------------------------------------------------------------------ running an example
FALLBACK = {"session_index": 0, "group_size": 1, "partition": "val", "global_step": 0}


async def event_count(ledger: Ledger) -> int:
    async with ledger.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(events))).scalar_one())


async def command(ledger: Ledger, name: str, call: Any) -> Any:
    """Run one command: its result, or None when it was refused (and then nothing was appended)."""
    before = await event_count(ledger)
    try:
        return await call()
    except InvalidInput as error:
        assert await event_count(ledger) == before, f"{name} refused ({error}) but appended"
        event(f"{name} refused: {error.field}")
        return None


async def record(ledger: Ledger, drawn: Session) -> None:
    create = dict(drawn.create)
    sid = create.pop("session_id")
    handle = await command(
        ledger,
        "create_session",
        lambda: ledger.create_session(sid, **create, start=drawn.start is None),
    )
    if handle is None:  # refused: a valid session carries the other commands
        handle = await ledger.create_session(
            f"fallback-{uuid.uuid4().hex[:8]}",
            uid=f"f{uuid.uuid4().hex[:8]}",
            **FALLBACK,
            start=drawn.start is None,
        )
    else:
        event("create_session accepted")
    if drawn.start is not None:
        if (
            await command(ledger, "start", lambda: handle.start(**drawn.start)) is None
            and handle.state == "created"
        ):
            await handle.start()
    for name, kwargs in drawn.steps:
        if name == "record_trajectory":
            await command(ledger, name, lambda kwargs=kwargs: handle.record_trajectory(**kwargs))
        else:
            info = kwargs.get("info", {})
            if not isinstance(info, dict) or not all(isinstance(k, str) for k in info):
                info = {}  # post_reward(**info): a caller cannot pass anything else
            info = {k: v for k, v in info.items() if k != "reward"}  # nor a second `reward`
            await command(
                ledger,
                name,
                lambda kwargs=kwargs, info=info: handle.post_reward(kwargs.get("reward"), **info),
            )
    if drawn.end is not None:
        name, kwargs = drawn.end[0], dict(drawn.end[1])
        if name == "fail":
            reason = kwargs.pop("reason")
            await command(ledger, name, lambda: handle.fail(reason, **kwargs))
        else:
            await command(ledger, name, lambda: getattr(handle, name)(**kwargs))
    event(f"session ended {handle.state}")


async def check_example(url: str, drawn: Session) -> None:
    await wipe(url)
    engine = create_engine(url)
    ledger = Ledger(engine)
    try:
        await record(ledger, drawn)
        await ledger.project()  # must not raise
        async with engine.connect() as conn:
            quarantined = [
                dict(r) for r in (await conn.execute(select(projection_errors))).mappings()
            ]
            projected = (
                await conn.execute(select(func.count()).select_from(sessions))
            ).scalar_one()
        assert quarantined == [], f"an accepted event was quarantined: {quarantined}"
        assert projected == 1, "the session's creation was accepted, so it must have a row"
    finally:
        await ledger.close()
        await engine.dispose()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for every example of the module (hypothesis calls the test synchronously)."""
    running = asyncio.new_event_loop()
    yield running
    running.close()


def _settings(backend: str) -> Any:
    return settings(
        max_examples=EXAMPLES[backend],
        deadline=None,
        derandomize=False,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


def test_every_value_is_refused_or_projected(
    module_db_url: str, loop: asyncio.AbstractEventLoop
) -> None:
    @_settings(backend_of(module_db_url))
    @given(drawn=session_commands())
    def example(drawn: Session) -> None:
        loop.run_until_complete(check_example(module_db_url, drawn))

    example()


# ------------------------------------------------------------------ every bounded column, checked
#: int32's largest: the longest number a key (`{uid}_{session_index}_{i}`) or metric name spells.
BIG = 2**31 - 1


def _marked_log() -> tuple[list[LogEvent], dict[str, tuple[str, str]]]:
    """A log that takes every rule that copies an event's text into a row, every string field of
    its events carrying a marker of its own; returns the log and marker -> (type, field).

    Four sessions: one retried, then failed with `keep_partial` (its trajectory's index and slot the
    largest a key can spell); one failed with a placeholder, its failure `exclude`d; one succeeded;
    one cancelled."""
    marks: dict[str, tuple[str, str]] = {}
    log: list[LogEvent] = []

    def add(sid: str, event: ev.Event, **steer: Any) -> None:
        data = {**event.to_data(), **steer}
        for name, declared in DECLARATION[event.TYPE].items():
            text = declared.spec().kind == "str" or declared.choices is not None
            if text and name not in steer:  # what steers the rules is set, not marked
                marker = f"~{len(marks):03d}~"
                marks[marker] = (event.TYPE, name)
                data[name] = marker
        log.append((len(log) + 1, sid, 0, event.TYPE, data, None, None))

    def created(sid: str, index: int, size: int) -> ev.SessionCreated:
        return ev.SessionCreated(
            run="r",
            uid="u",
            session_index=index,
            group_size=size,
            partition="train",
            global_step=BIG,
            data_source="d",
            runner="x",
            min_valid=BIG,
        )

    trajectory = ev.TrajectoryRecorded(
        index=BIG, num_turns=1, prompt_len=1, response_len=1, has_logprobs=False
    )
    fields = {"error_type": "E", "message": "m", "discarded_trajectories": 0}
    add("kept", created("kept", BIG - 1, BIG))
    add("kept", ev.SessionStarted(attempt=1))
    add("kept", ev.AttemptFailed(attempt=1, reason="r", origin="o", **fields))
    add("kept", ev.SessionStarted(attempt=2))
    add("kept", trajectory)
    add("kept", ev.RewardPosted(reward=1.0))
    failed = ev.SessionFailed(reason="r", selected=[BIG], score=1.0, **fields)
    add("kept", failed, placeholder=KEEP_PARTIAL)
    add("emitted", created("emitted", 0, 1))
    add("emitted", ev.SessionFailed(reason="r", **fields), placeholder=EMIT, metric=EXCLUDE)
    add("emitted", ev.PlaceholderEmitted(reason="r", token_id=0))
    add("succeeded", created("succeeded", BIG - 1, BIG))
    add("succeeded", trajectory)
    add("succeeded", ev.RewardPosted(reward=1.0))
    succeeded = ev.SessionSucceeded(
        selected=[BIG], trajectory_selection="all", score=1.0, score_source="s"
    )
    add("succeeded", succeeded)
    add("cancelled", created("cancelled", 0, 1))
    add("cancelled", ev.SessionCancelled(message="m"))
    return log, marks


def _cells(state: WorkingSet) -> list[tuple[str, Any]]:
    """Every (table.column, value) the rules produced, as the projector would write them."""
    cells: list[tuple[str, Any]] = []
    for table, rows in (
        ("sessions", state.sessions.values()),
        ("groups", state.groups.values()),
        ("queue_rows", state.queue),
        ("projection_errors", state.errors),
    ):
        cells += [(f"{table}.{column}", value) for row in rows for column, value in row.items()]
    for scope, metrics in state.metrics.items():
        columns = ("run", "partition", "global_step", "data_source")
        cells += [(f"metric_counts.{column}", value) for column, value in zip(columns, scope)]
        cells += [("metric_counts.metric", name) for name in metrics.values]
    return cells


def flows() -> dict[tuple[str, str], set[tuple[str, int]]]:
    """(event type, field) -> {(table.column, characters around it)}: where each field's text
    lands when the marked log is projected, whole (0 around it) or inside a longer text."""
    log, marks = _marked_log()
    state = WorkingSet()
    rules = Rules(state)
    rules.apply_all(log)
    rules.finish()
    assert state.errors == [], f"the marked log was quarantined: {state.errors}"
    found: dict[tuple[str, str], set[tuple[str, int]]] = {}
    for column, value in _cells(state):
        if isinstance(value, str):
            for marker, source in marks.items():
                if marker in value:
                    found.setdefault(source, set()).add((column, len(value) - len(marker)))
    return found


def test_every_field_that_flows_into_a_bounded_column_is_checked_against_it() -> None:
    """docs/design.md §4: nothing is appended that cannot be projected. For every event field whose
    text the rules copy into a bounded column (found by projecting marked events, not listed by
    hand), the field's declaration must bound it by a column no wider than that one, less the
    characters the rule writes around it; else a long value is accepted at append and fails only
    when the projector writes its row (on PostgreSQL; SQLite does not check lengths)."""
    found = flows()
    assert ("SessionFailed", "origin") in found and ("PlaceholderEmitted", "reason") in found
    assert ("queue_rows.key", 22) in found[("SessionCreated", "uid")]  # `_{BIG - 1}_{BIG}`
    wrong = []
    for (type_, name), targets in sorted(found.items()):
        declared = DECLARATION[type_][name]
        spec = declared.spec()
        for column, around in sorted(targets):
            width = column_spec(column).max_length
            if width is None:
                continue
            if spec.kind != "str" or spec.max_length is None:
                wrong.append(
                    f"{type_}.{name} flows into {column} (at most {width} characters) but "
                    "declares no bounded column: name it in sessions/storable.py"
                )
            elif spec.max_length + around > width:
                wrong.append(
                    f"{type_}.{name} may hold {spec.max_length} characters ({spec.name}), "
                    f"which with {around} around it overflow {column} ({width})"
                )
    assert wrong == [], "\n".join(wrong)


def test_the_envelope_columns_are_as_wide_as_the_fields_they_copy() -> None:
    """The store copies a creation's run, uid and partition into the events table's own columns
    (at append, before any projection): they must take whatever the fields may hold."""
    for name in ("run", "uid", "partition"):
        declared = DECLARATION["SessionCreated"][name].spec()
        envelope = column_spec(f"events.{name}").max_length
        assert declared.max_length is not None and envelope is not None
        assert declared.max_length <= envelope, name


def test_the_events_cuts_are_their_columns_widths() -> None:
    """`aggregate` cuts a failure's message and error type to `events.MESSAGE_LIMIT` and
    `ERROR_TYPE_LIMIT` before the check: numbers that must be the columns' widths, or a message
    would be cut twice (shorter) or a note of `recorded_failure` lost."""
    assert ev.MESSAGE_LIMIT == DECLARATION["SessionFailed"]["message"].spec().max_length
    assert ev.ERROR_TYPE_LIMIT == DECLARATION["SessionFailed"]["error_type"].spec().max_length


BOUNDED = sorted(
    (type_, name)
    for type_, fields in DECLARATION.items()
    for name, declared in fields.items()
    if declared.spec().kind == "str" and declared.spec().max_length is not None
)
#: A valid event of each type that has a bounded field, to put one drawn value into.
VALID: dict[str, ev.Event] = {
    "SessionCreated": ev.SessionCreated(
        run="r", uid="u", session_index=0, group_size=1, partition="train", global_step=0
    ),
    "TrajectoryRecorded": ev.TrajectoryRecorded(
        index=0, num_turns=1, prompt_len=1, response_len=1, has_logprobs=False
    ),
    "SessionSucceeded": ev.SessionSucceeded(
        selected=[0], trajectory_selection="all", score=1.0, score_source="external"
    ),
    "SessionFailed": ev.SessionFailed(
        reason="timeout", error_type="E", message="m", discarded_trajectories=0
    ),
    "AttemptFailed": ev.AttemptFailed(
        attempt=1,
        reason="timeout",
        origin="policy",
        error_type="E",
        message="m",
        discarded_trajectories=0,
    ),
    "PlaceholderEmitted": ev.PlaceholderEmitted(reason="timeout", token_id=0),
    "SessionCancelled": ev.SessionCancelled(message="m"),
    "ModelCallStarted": ev.ModelCallStarted(call_id="c", turn=0),
    "ModelCallRecorded": ev.ModelCallRecorded(
        call_id="c", prompt_shared=0, prompt_len=1, response_len=1, has_logprobs=False
    ),
    "ModelCallFailed": ev.ModelCallFailed(call_id="c", error_type="E", message="m"),
    "RunLaunched": ev.RunLaunched(launch="job", number=1),
}
#: Text every bounded field takes (no `_`: a uid refuses it; lowercase: a reason's own rule).
STORABLE = st.characters(min_codepoint=ord("a"), max_codepoint=ord("z"))


def test_every_bounded_field_is_known() -> None:
    assert {type_ for type_, _ in BOUNDED} == set(VALID)
    assert ("SessionFailed", "origin") in BOUNDED and ("SessionFailed", "metric") in BOUNDED


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(BOUNDED), data=st.data())
def test_a_value_longer_than_its_column_is_refused_or_cut_at_record_time(
    field: tuple[str, str], data: st.DataObject
) -> None:
    """Longer than its column: refused naming the field, or (free text, docs/design.md §4) escaped
    and cut to fit; never accepted as it is."""
    type_, name = field
    declared = DECLARATION[type_][name]
    width = declared.spec().max_length
    assert width is not None
    text = data.draw(st.text(STORABLE, min_size=width + 1, max_size=width + 40), label="text")
    event = dataclasses.replace(VALID[type_], **{name: text})
    if declared.free_text:
        cleaned, stored = storable.clean_event_data("s", event)
        assert stored[name] == text[:width] and getattr(cleaned, name) == text[:width]
        return
    with pytest.raises(InvalidInput) as refused:
        storable.clean_event_data("s", event)
    assert refused.value.field == name, refused.value


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(BOUNDED), data=st.data())
def test_a_value_as_long_as_its_column_is_accepted_unless_it_is_no_choice(
    field: tuple[str, str], data: st.DataObject
) -> None:
    """At exactly its column's width a value is accepted as it is; a field with choices takes
    nothing but its choices, at any length (its choices fit: the next test)."""
    type_, name = field
    declared = DECLARATION[type_][name]
    width = declared.spec().max_length
    assert width is not None
    text = data.draw(st.text(STORABLE, min_size=width, max_size=width), label="text")
    event = dataclasses.replace(VALID[type_], **{name: text})
    if declared.choices is not None and text not in declared.choices:
        with pytest.raises(InvalidInput, match="must be one of"):
            storable.clean_event_data("s", event)
        return
    cleaned, stored = storable.clean_event_data("s", event)
    assert stored[name] == text and getattr(cleaned, name) == text


def test_every_choice_fits_its_column() -> None:
    for type_, name in BOUNDED:
        declared = DECLARATION[type_][name]
        for choice in declared.choices or ():
            assert declared.spec().problem(choice) is None, (type_, name, choice)


def test_a_choice_its_column_cannot_store_is_refused_not_accepted() -> None:
    """Were an origin declared longer than `sessions.failure_origin` (8 characters), the check at
    append would refuse it, on the fast path (which passes only what is certainly storable) and
    the full one, naming the column's width."""
    declared = storable.Field(
        "sessions.failure_origin", nullable=False, choices=("eightchr", "ninechars")
    )
    spec = declared.spec()
    fast = storable._compile_fast("T", [("origin", declared, spec)])
    assert fast({"origin": "eightchr"})
    assert storable._problem("origin", declared, spec, "eightchr") is None
    assert not fast({"origin": "ninechars"})
    problem = storable._problem("origin", declared, spec, "ninechars")
    assert problem is not None and "more than the 8" in problem


async def _record_at_width(url: str, texts: dict[str, str]) -> None:
    """Record sessions whose every bounded field holds `texts[field]` (each at its column's
    width), through the public API, and project them: nothing quarantined, every value stored."""
    await wipe(url)
    engine = create_engine(url)
    ledger = Ledger(engine)
    try:
        identity = {
            "run": texts["run"],
            "uid": texts["uid"],
            "data_source": texts["data_source"],
            "runner": texts["runner"],
            "partition": "train",
            "group_size": 3,
            "global_step": 0,
        }
        succeeded = await ledger.create_session("ok", session_index=0, **identity)
        await succeeded.record_trajectory(
            prompt_ids=[1], response_ids=[2], materialization_reason=texts["materialization_reason"]
        )
        await succeeded.post_reward(1.0)
        await succeeded.complete()
        failed = await ledger.create_session("failed", session_index=1, **identity)
        await failed.retry(
            texts["reason"], message=texts["message"], error_type=texts["error_type"]
        )
        await failed.start()
        await failed.fail(texts["reason"], message=texts["message"], error_type=texts["error_type"])
        cancelled = await ledger.create_session("cancelled", session_index=2, **identity)
        await cancelled.cancel(texts["message"])
        await ledger.project()
        async with engine.connect() as conn:
            assert (await conn.execute(select(projection_errors))).all() == []
            rows = {r.session_id: r for r in (await conn.execute(select(sessions))).all()}
            queue = (await conn.execute(select(queue_rows).where(queue_rows.c.kind == "row"))).all()
        assert set(rows) == {"ok", "failed", "cancelled"}
        for row in rows.values():
            assert (row.run, row.uid, row.data_source, row.runner) == (
                texts["run"],
                texts["uid"],
                texts["data_source"],
                texts["runner"],
            )
        failure = rows["failed"]
        assert (failure.failure_reason, failure.message, failure.error_type) == (
            texts["reason"],
            texts["message"],
            texts["error_type"],
        )
        assert rows["cancelled"].message == texts["message"]
        assert {(q.failure_reason, q.materialization_reason) for q in queue} == {
            (None, texts["materialization_reason"]),
            (texts["reason"], "session_failed"),
        }
    finally:
        await ledger.close()
        await engine.dispose()


def _at_width(column: str, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> st.SearchStrategy[str]:
    width = column_spec(column).max_length
    assert width is not None
    return st.text(st.sampled_from(alphabet), min_size=width, max_size=width)


def test_values_as_long_as_their_columns_are_recorded_and_projected(
    module_db_url: str, loop: asyncio.AbstractEventLoop
) -> None:
    """What the checks accept at exactly a column's width the database stores (PostgreSQL's
    `varchar(n)` checks it), through every rule that copies it."""

    @settings(
        max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(
        texts=st.fixed_dictionaries(
            {
                "run": _at_width("sessions.run"),
                "uid": _at_width("sessions.uid"),
                "data_source": _at_width("sessions.data_source"),
                "runner": _at_width("sessions.runner"),
                "materialization_reason": _at_width("queue_rows.materialization_reason"),
                "reason": _at_width("sessions.failure_reason"),
                "error_type": _at_width("sessions.error_type", "Ab.Cd:é"),
                "message": _at_width("sessions.message", "ab é☃🙂\n"),
            }
        )
    )
    def example(texts: dict[str, str]) -> None:
        loop.run_until_complete(_record_at_width(module_db_url, texts))

    example()
