"""One vocabulary (docs/design.md §2): every name a caller gives follows one rule, at every entry.

The rules are restated here as plain predicates (`RULES`), independently of `sessions.vocabulary`,
and every entry point that takes a name is one row of `ENTRIES`: the function that hands it the
name, the field its refusal must name, and what it accepts beside the rule's names (a policy's
rules also take the origins and `*`). For generated names on both sides of each rule, every
entry point of that rule must agree with the predicate, and refuse with exactly `InvalidInput`
naming the field. A new entry point, or a new rule, is a new row: it is then tested everywhere.

SQLite only: the rules are decided before any SQL runs, and a name a rule accepts holds no NUL
or lone surrogate that one backend would store and another refuse.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, MetricPolicy, PlaceholderPolicy, RetryPolicy, RolloutFailure
from sessions import vocabulary as vocab
from sessions.errors import InvalidInput
from sessions.export import export_dataset
from sessions.projection.metrics import MetricRow
from sessions.projection.verl_metrics import ledger_metrics, metrics_dict
from sessions.queues.consumer import QueueConsumer
from tests.conftest import fresh_database

RUN = "r0"
BUILT_IN = (
    "runner_error",
    "timeout",
    "sandbox_error",
    "empty_output",
    "finalize_error",
    "invalid_output",
    "orphaned",
)


# --------------------------------------------------------------------------- the rules, restated
def _is_text(value: Any) -> bool:
    if not isinstance(value, str) or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_name(value: Any) -> bool:
    """An id or label: non-empty text of at most 128 characters (every table's VARCHAR(128))."""
    return _is_text(value) and 1 <= len(value) <= 128


def _is_reason(value: Any) -> bool:
    return isinstance(value, str) and (
        value in BUILT_IN
        or (
            value not in ("infra", "policy", "*", "unprojectable")
            and re.fullmatch(r"[a-z][a-z0-9_]{0,31}", value) is not None
        )
    )


RULES: dict[str, Callable[[Any], bool]] = {
    "partition": lambda v: isinstance(v, str) and v in ("train", "val"),
    "run": _is_name,
    "session_id": lambda v: _is_name(v) and not v.startswith("@run:"),
    "uid": lambda v: _is_name(v) and "_" not in v,
    "data_source": lambda v: v is None or (_is_name(v) and v != "all"),
    "reason": _is_reason,
    "runner_reason": lambda v: _is_reason(v) and v != "orphaned",
}
#: The field a refusal names, per rule (a runner's reason is still the `reason`).
FIELD = {rule: rule for rule in RULES} | {"runner_reason": "reason"}


# ----------------------------------------------------------------------------- the entry points
@dataclass
class Env:
    """One ledger for the module: run `r0` has a settled step 0 in both partitions."""

    ledger: Ledger
    folder: Path
    counter: Iterator[int]
    created: set[str] = field(default_factory=set)  # session ids given by name and accepted

    def fresh(self) -> int:
        return next(self.counter)

    async def create(self, **identity: Any) -> Any:
        """A session of a group of its own (a step nobody else uses), any field replaced."""
        n = self.fresh()
        given = {
            "uid": "u",
            "session_index": 0,
            "group_size": 1,
            "partition": "val",
            "global_step": 1000 + n,
            **identity,
        }
        session_id = given.pop("session_id", f"s{n}")
        if session_id in self.created:
            return None  # accepted by an earlier example; a second session may not take it
        handle = await self.ledger.create_session(session_id, **given)
        self.created.add(session_id)
        return handle


Give = Callable[[Env, Any], Awaitable[Any]]


@dataclass(frozen=True)
class Entry:
    rule: str
    where: str
    give: Give
    field: str | None = None  # the field its refusal names, when not the rule's own
    also: tuple[str, ...] = ()  # names it accepts beside the rule's
    optional: bool = False  # None is its default (both partitions, the ledger's run), not a name


def _sync(call: Callable[[Env, Any], Any]) -> Give:
    async def give(env: Env, value: Any) -> Any:
        return call(env, value)

    return give


async def _fail(env: Env, value: Any) -> None:
    handle = await env.create()
    await handle.fail(value)


async def _retry(env: Env, value: Any) -> None:
    handle = await env.create()
    await handle.retry(value)


async def _export(env: Env, **options: Any) -> Any:
    path = env.folder / f"export-{env.fresh()}.jsonl"
    return await export_dataset(env.ledger, path, format="jsonl", **options)


def _row(data_source: Any) -> MetricRow:
    return MetricRow(RUN, "val", 0, data_source, "sessions/total", 1.0)


ENTRIES: list[Entry] = [
    # partition
    Entry("partition", "vocabulary", _sync(lambda _, v: vocab.check_partition(v))),
    Entry("partition", "create_session", lambda env, v: env.create(partition=v)),
    Entry(
        "partition",
        "QueueConsumer",
        _sync(lambda env, v: QueueConsumer(env.ledger, "c", run=RUN, partition=v)),
    ),
    Entry("partition", "export_dataset", lambda env, v: _export(env, partition=v), optional=True),
    Entry("partition", "Ledger.metrics", lambda env, v: env.ledger.metrics(v, 0), optional=True),
    Entry("partition", "Ledger.metrics_dict", lambda env, v: env.ledger.metrics_dict(v, 0)),
    Entry("partition", "Ledger.batch", lambda env, v: env.ledger.batch(v, 0)),
    Entry("partition", "verl_metrics.metrics_dict", _sync(lambda _, v: metrics_dict(v, [], []))),
    Entry(
        "partition",
        "MetricPolicy(rules=)",
        _sync(lambda _, v: MetricPolicy(rules={v: {"timeout": "zero"}})),
        field="metric policy: rules",
        also=("*",),
    ),
    Entry(
        "partition",
        "PlaceholderPolicy(rules=)",
        _sync(lambda _, v: PlaceholderPolicy(rules={v: {"timeout": "drop"}})),
        field="placeholder policy: rules",
        also=("*",),
    ),
    # run
    Entry("run", "vocabulary", _sync(lambda _, v: vocab.check_run(v))),
    Entry("run", "create_session", lambda env, v: env.create(run=v), optional=True),
    Entry(
        "run",
        "QueueConsumer",
        _sync(lambda env, v: QueueConsumer(env.ledger, "c", run=v, partition="val")),
    ),
    Entry("run", "export_dataset", lambda env, v: _export(env, run=v), optional=True),
    Entry("run", "Ledger.metrics", lambda env, v: env.ledger.metrics(run=v), optional=True),
    Entry(
        "run",
        "Ledger.metrics_dict",
        lambda env, v: env.ledger.metrics_dict("val", 0, run=v, timeout=0),
        optional=True,
    ),
    # session id
    Entry("session_id", "vocabulary", _sync(lambda _, v: vocab.check_session_id(v))),
    Entry("session_id", "create_session", lambda env, v: env.create(session_id=v)),
    # uid
    Entry("uid", "vocabulary", _sync(lambda _, v: vocab.check_uid(v))),
    Entry("uid", "create_session", lambda env, v: env.create(uid=v)),
    # data source
    Entry("data_source", "vocabulary", _sync(lambda _, v: vocab.check_data_source(v))),
    Entry("data_source", "create_session", lambda env, v: env.create(data_source=v)),
    Entry("data_source", "ledger_metrics", _sync(lambda _, v: ledger_metrics([_row(v)]))),
    # failure reasons as the ledger records them
    Entry("reason", "vocabulary", _sync(lambda _, v: vocab.check_reason(v))),
    Entry("reason", "SessionHandle.fail", _fail),
    Entry("reason", "SessionHandle.retry", _retry),
    Entry(
        "reason",
        "MetricPolicy(rules=)",
        _sync(lambda _, v: MetricPolicy(rules={"val": {v: "exclude"}})),
        field="metric policy: rules['val']",
        also=("infra", "policy", "*"),
    ),
    Entry(
        "reason",
        "MetricPolicy(origins=)",
        _sync(lambda _, v: MetricPolicy(origins={v: "infra"})),
        field="metric policy: origins",
    ),
    Entry(
        "reason",
        "PlaceholderPolicy(rules=)",
        _sync(lambda _, v: PlaceholderPolicy(rules={"train": {v: "drop"}})),
        field="placeholder policy: rules['train']",
        also=("infra", "policy", "*"),
    ),
    Entry(
        "reason",
        "RetryPolicy(on=)",
        _sync(lambda _, v: RetryPolicy(max_attempts=2, on=(v,))),
        field="retry policy: on",
        also=("infra", "policy"),
    ),
    # failure reasons as a runner gives them
    Entry("runner_reason", "vocabulary", _sync(lambda _, v: vocab.check_runner_reason(v))),
    Entry(
        "runner_reason",
        "RolloutFailure",
        _sync(lambda _, v: RolloutFailure("x", reason=v)),
        optional=True,  # None: the class's own reason
    ),
]

# Names on both sides of every rule: the edges spelt out, then generated text and other types
# (hashable ones: several entries take the name as a dict key, which a list cannot be).
EDGES = [
    *("train", "val", "TRAIN", "Val", "test", "train ", "*"),
    *("all", "ALL", "all-math", "math", "a_b", "a-b", "@run:x", "x@run:"),
    *("infra", "policy", "unprojectable", "orphaned", "Orphaned", "tool_quota", "Tool-Quota"),
    *BUILT_IN,
    *("", " ", "a\x00b", "a\ud800b", "é☃🙂", "_", "1abc", "a" * 32, "a" * 33, "y" * 128, "y" * 129),
]
NAMES = st.one_of(
    st.sampled_from(EDGES),
    st.text(max_size=6),
    st.text(st.sampled_from("ab_-"), min_size=126, max_size=130),
    st.from_regex(r"[a-z][a-z0-9_]{0,34}", fullmatch=True),
    st.none(),
    st.integers(),
    st.binary(max_size=3),
    st.tuples(st.text(max_size=2)),
)


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for every example of the module (hypothesis calls the test synchronously)."""
    running = asyncio.new_event_loop()
    yield running
    running.close()


@pytest.fixture(scope="module")
def env(loop: asyncio.AbstractEventLoop, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    folder = tmp_path_factory.mktemp("vocabulary")
    with fresh_database("sqlite", folder) as url:
        opened = Ledger.open(url, run=RUN)
        ledger = loop.run_until_complete(opened.__aenter__())
        environment = Env(ledger, folder, itertools.count())

        async def settle(partition: str) -> None:
            handle = await ledger.create_session(
                f"settled-{partition}",
                uid="settled",
                session_index=0,
                group_size=1,
                partition=partition,
                global_step=0,
                data_source="math",
            )
            await handle.record_trajectory(prompt_ids=[1, 2], response_ids=[3])
            await handle.post_reward(1.0)
            await handle.complete()

        for partition in ("train", "val"):
            loop.run_until_complete(settle(partition))
        yield environment
        loop.run_until_complete(opened.__aexit__(None, None, None))


# ---------------------------------------------------------------------------------------- tests
def test_every_rule_has_entry_points_beyond_its_own_check() -> None:
    assert {e.rule for e in ENTRIES} == set(RULES)
    for rule in RULES:
        assert [e.where for e in ENTRIES if e.rule == rule][0] == "vocabulary", rule
        assert len([e for e in ENTRIES if e.rule == rule]) >= 2, f"{rule}: no entry point"


async def _verdict(env: Env, entry: Entry, value: Any) -> BaseException | None:
    try:
        await entry.give(env, value)
    except Exception as error:  # noqa: BLE001 - what the entry raised is the verdict
        return error
    return None


async def _check(env: Env, rule: str, value: Any) -> None:
    for entry in (e for e in ENTRIES if e.rule == rule):
        accepted = (
            RULES[rule](value)
            or (isinstance(value, str) and value in entry.also)
            or (value is None and entry.optional)
        )
        error = await _verdict(env, entry, value)
        named = entry.field or FIELD[rule]
        if accepted:
            # Accepted: whatever else happens (a run without sessions, a step not settled in
            # time), it is not a refusal of the name.
            assert not isinstance(error, InvalidInput), (
                f"{entry.where} refused {value!r} that the {rule} rule accepts: {error}"
            )
        else:
            assert error is not None, f"{entry.where} accepted {value!r:.80}"
            assert type(error) is InvalidInput, (
                f"{entry.where} refused {value!r:.80} with {type(error).__name__}: {error}"
            )
            assert error.field == named, f"{entry.where}: field {error.field!r}: {error}"
            assert str(error).startswith(
                f"session {error.session_id!r}: {named}:" if error.session_id else f"{named}:"
            ), str(error)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_entry_point_gives_the_rules_verdict(
    rule: str, env: Env, loop: asyncio.AbstractEventLoop
) -> None:
    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(value=NAMES)
    def example(value: Any) -> None:
        loop.run_until_complete(_check(env, rule, value))

    example()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_entry_point_gives_the_rules_verdict_on_the_edges(
    rule: str, env: Env, loop: asyncio.AbstractEventLoop
) -> None:
    """Every spelt-out edge at every entry, whatever hypothesis happens to draw; they put each
    rule on both sides."""
    assert {RULES[rule](value) for value in EDGES} == {True, False}, rule
    for value in (*EDGES, None, 1, b"ab", ("train",)):
        loop.run_until_complete(_check(env, rule, value))


def test_a_data_source_the_metrics_spell_is_refused_when_created(
    env: Env, loop: asyncio.AbstractEventLoop
) -> None:
    """`all` was once recorded, then the step's metrics and trackers failed with a plain
    ValueError; now the session is refused, naming the field and the reserved name."""
    with pytest.raises(InvalidInput) as refused:
        loop.run_until_complete(env.create(session_id="all-source", data_source="all"))
    message = str(refused.value)
    assert refused.value.field == "data_source" and refused.value.session_id == "all-source"
    assert message.startswith("session 'all-source': data_source: 'all' is reserved"), message
    with pytest.raises(InvalidInput, match="no such session"):
        loop.run_until_complete(env.ledger.load_session("all-source"))  # nothing was written


def test_the_name_lengths_are_the_columns_widths() -> None:
    """The vocabulary stays free of SQL (the CLI builds its parser from it), so it states its
    lengths as numbers; they are the widths of the columns the names are stored in, read from
    the table declaration, so a rule and its column cannot drift apart."""
    from store import column_spec

    for column in ("sessions.session_id", "sessions.run", "sessions.uid", "sessions.runner"):
        assert column_spec(column).max_length == vocab.MAX_NAME_LENGTH, column
    assert column_spec("sessions.data_source").max_length == vocab.MAX_NAME_LENGTH
    for column in ("sessions.failure_reason", "queue_rows.failure_reason"):
        assert column_spec(column).max_length == vocab.MAX_REASON_LENGTH, column
