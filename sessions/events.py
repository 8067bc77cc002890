"""Domain events: immutable typed records, a registry by stable type name, and upcasters.

An event's `TYPE` is its name in the log forever; `SCHEMA_VERSION` is bumped when its shape
changes, and an upcaster registered for (type, old version) lifts old data to the new shape, so
replaying old logs keeps working (docs/design.md §4). Token arrays travel in the binary payload, not in
the JSON data.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar

from sessions.errors import UnknownEventError
from sessions.failure_policy import DEFAULT_ORIGINS, ZERO
from sessions.placeholder import EMIT
from sessions.vocabulary import FAILURE_REASONS, POLICY, RUN_STREAM_PREFIX
from store import NewEvent, StoredEvent

if TYPE_CHECKING:
    from sessions.tokens import TokenArrays

__all__ = [
    "AttemptFailed",
    "BreakerTripped",
    "DEFAULT_MIN_VALID",
    "DEFAULT_ORIGINS",
    "ERROR_TYPE_LIMIT",
    "EVENT_TYPES",
    "Event",
    "FAILURE_REASONS",
    "MESSAGE_LIMIT",
    "ModelCallFailed",
    "ModelCallRecorded",
    "ModelCallStarted",
    "PlaceholderEmitted",
    "Recorded",
    "RUN_STREAM_PREFIX",
    "RewardPosted",
    "PayloadsPruned",
    "RunConfigured",
    "RunLaunched",
    "RUN_STREAM_EVENTS",
    "SessionCancelled",
    "SessionCreated",
    "SessionFailed",
    "SessionStarted",
    "SessionSucceeded",
    "TERMINAL_EVENTS",
    "TrajectoryRecorded",
    "UPCASTERS",
    "decode",
    "envelope",
    "new_event_id",
    "upcast",
    "upcaster",
]

MESSAGE_LIMIT = 512
#: error_type is a class name; the sessions read model stores it in VARCHAR(128).
ERROR_TYPE_LIMIT = 128

#: GRPO's default `min_valid`: a group needs two valid (non-placeholder) rows for a baseline, as
#: NeMo-RL and TRL have it (`SessionCreated.min_valid` None means this).
DEFAULT_MIN_VALID = 2


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """Field names per event class, computed once: `dataclasses.fields` is slow on the hot path."""
    return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of all domain events (the data part; the envelope is `Recorded`)."""

    TYPE: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1
    #: fields stored elsewhere than in the JSON data (a trajectory's token payload)
    DATA_EXCLUDED: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls) -> None:  # no super(): `slots=True` makes Event a new class
        if "to_data" not in cls.__dict__:  # not a registered type's generated one, which lists
            cls.to_data = Event.to_data  # type: ignore[method-assign]  # only that type's fields

    def to_data(self) -> dict[str, Any]:
        # The registered types get a generated `to_data` (`_data_function`); this is the rest's.
        excluded = type(self).DATA_EXCLUDED
        return {
            name: getattr(self, name) for name in _field_names(type(self)) if name not in excluded
        }

    def to_payload(self) -> bytes | None:
        return None

    @classmethod
    def from_data(cls, data: Mapping[str, Any], payload: bytes | None) -> Event:
        names = _field_names(cls)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCreated(Event):
    """Schema 2 added `launch`: the number of the run's launch that created the session
    (`RunLaunched.number`; None when the ledger records no launches), so a step re-run by a
    later launch supersedes the earlier launch's sessions (docs/design.md §14)."""

    TYPE: ClassVar[str] = "SessionCreated"
    SCHEMA_VERSION: ClassVar[int] = 2
    run: str
    uid: str
    session_index: int
    group_size: int
    partition: str
    global_step: int | None
    data_source: str | None = None
    runner: str | None = None
    sample_index: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: GRPO: a group with fewer valid (non-placeholder) rows than this gives no signal; counted
    #: under `groups/below_min_valid` (None: `DEFAULT_MIN_VALID`).
    min_valid: int | None = None
    launch: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionStarted(Event):
    TYPE: ClassVar[str] = "SessionStarted"
    attempt: int | None = None
    timeout_s: float | None = None


class _TokenPayload:
    """An event whose token arrays travel in the binary payload, beside its JSON data: the
    payload is stored as given, and its arrays decoded only when read (folds never need them)."""

    __slots__ = ()
    DATA_EXCLUDED: ClassVar[tuple[str, ...]] = ("payload",)
    payload: bytes
    prompt_len: int
    response_len: int
    has_logprobs: bool

    def to_payload(self) -> bytes | None:
        return self.payload

    @classmethod
    def from_data(cls, data: Mapping[str, Any], payload: bytes | None) -> Event:
        event = Event.from_data.__func__(cls, data, None)  # type: ignore[attr-defined]
        return dataclasses.replace(event, payload=payload or b"")

    def arrays(self) -> TokenArrays:
        from sessions import tokens  # numpy, loaded only when token arrays are read (issue 28)

        return tokens.decode(self.payload, self.prompt_len, self.response_len, self.has_logprobs)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryRecorded(_TokenPayload, Event):
    """One trajectory; its token arrays are the payload (decoded lazily: folds never need them).

    Schema 2 added `trainable_tokens`, the count of response tokens with mask 1, so metrics,
    `history` and audits read it without decoding the payload. `None` means unknown: an event
    built without it, or schema-1 data upcast by a reader that did not load the payload. Schema 3
    added the weights versions and the model calls it was assembled from.
    """

    TYPE: ClassVar[str] = "TrajectoryRecorded"
    SCHEMA_VERSION: ClassVar[int] = 3
    index: int
    num_turns: int
    prompt_len: int
    response_len: int
    has_logprobs: bool
    trainable_tokens: int | None = None
    materialization_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: the weights versions (verl's `global_steps`) that produced the response: the lowest and the
    #: highest; None when unknown (schema 3)
    min_version: int | None = None
    max_version: int | None = None
    #: the call ids it was assembled from, in order (`sessions.calls`); empty when the runner
    #: handed the trajectory over whole (schema 3)
    from_calls: list[str] = field(default_factory=list)
    payload: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCallStarted(Event):
    """A model call about to be dispatched (its intent), appended before the request leaves: a
    call with an intent and neither record nor failure when the session completes makes the
    capture incomplete, and the session fails closed (docs/design.md §15)."""

    TYPE: ClassVar[str] = "ModelCallStarted"
    call_id: str
    turn: int
    sampling: dict[str, Any] = field(default_factory=dict)
    #: the weights version asked for, if the caller knows it
    version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCallRecorded(_TokenPayload, Event):
    """A model call's answer, appended before the caller gets it.

    The payload lays out the call as `tokens.encode` lays out a trajectory (mask all ones): the
    prompt's tokens after its first `prompt_shared`, which it shares with the context of the call
    recorded before it in the attempt (that call's prompt and response), then the response and
    its log-probs. A multi-turn conversation so costs its new tokens once, not once per turn.
    """

    TYPE: ClassVar[str] = "ModelCallRecorded"
    call_id: str
    prompt_shared: int
    prompt_len: int
    response_len: int
    has_logprobs: bool
    finish_reason: str | None = None
    min_version: int | None = None
    max_version: int | None = None
    latency_s: float | None = None
    server: str | None = None
    #: the response's text, only where the caller gives it
    text: str | None = None
    #: `arrays()`: the prompt's new tokens (after `prompt_shared`), the response, its log-probs
    payload: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCallFailed(Event):
    """A model call that ended without an answer (the server refused, timed out, the connection
    dropped): the call is settled, its tokens never reach a row."""

    TYPE: ClassVar[str] = "ModelCallFailed"
    call_id: str
    error_type: str | None
    message: str
    latency_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardPosted(Event):
    TYPE: ClassVar[str] = "RewardPosted"
    reward: float | None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSucceeded(Event):
    TYPE: ClassVar[str] = "SessionSucceeded"
    selected: list[int]
    trajectory_selection: str
    score: float | None
    score_source: str
    finished: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptFailed(Event):
    """One attempt of a session failed and another will follow (the retry policy said so): the
    attempt's trajectories and reward are superseded — kept in the log, never in a batch."""

    TYPE: ClassVar[str] = "AttemptFailed"
    attempt: int
    reason: str
    origin: str
    error_type: str | None
    message: str
    discarded_trajectories: int
    retry_in_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFailed(Event):
    """Schema 2 added `origin` and `metric` (the failure's origin and metric policy) and, for a
    `keep_partial` decision, the `selected` trajectories sent with `score`; schema 3
    `retry_refused`, the retry budget (`group_budget`, `step_budget`) that refused the retry the
    policy would have made. Every decision is recorded here so replay never consults today's
    configuration."""

    TYPE: ClassVar[str] = "SessionFailed"
    SCHEMA_VERSION: ClassVar[int] = 3
    reason: str
    error_type: str | None
    message: str
    discarded_trajectories: int
    placeholder: str = EMIT  # a choice of `placeholder.DECISIONS` (a fallback is recorded as emit)
    origin: str = POLICY
    metric: str = ZERO  # a choice of `failure_policy.METRIC_DECISIONS`
    selected: list[int] = field(default_factory=list)
    score: float | None = None
    retry_refused: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceholderEmitted(Event):
    """Schema 2 added the placeholder's lengths (`prompt_len`, `response_len`)."""

    TYPE: ClassVar[str] = "PlaceholderEmitted"
    SCHEMA_VERSION: ClassVar[int] = 2
    reason: str
    token_id: int
    reward: float = 0.0
    finished: bool = False
    materialization_reason: str = "session_failed"
    reward_info: dict[str, Any] = field(default_factory=dict)
    prompt_len: int = 1
    response_len: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfigured(Event):
    """A run's configuration and its digest, in the run's own stream (`@run:<run>`), appended when
    a ledger first writes to the run and again when it is resumed with another configuration
    (`change` names the keys that changed)."""

    TYPE: ClassVar[str] = "RunConfigured"
    digest: str
    config: dict[str, Any] = field(default_factory=dict)
    change: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLaunched(Event):
    """A launch of the run (a job's start or its resume from a checkpoint), in the run's own
    stream (`@run:<run>`), recorded once per launch id by the first of its processes to write.
    `number` counts the run's launches from 1, in the stream's order; `resumed` says the run
    had sessions already, and `last_steps` the last step each partition had then. Every session
    the launch creates carries its `number` (`SessionCreated.launch`): a step a later launch
    re-runs counts that launch's sessions only (docs/design.md §14)."""

    TYPE: ClassVar[str] = "RunLaunched"
    launch: str
    number: int
    resumed: bool = False
    last_steps: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerTripped(Event):
    """The run's circuit breaker tripped (`sessions.runs.breaker`), in the run's own stream: no
    session of the run is created until its next launch. `rule` is the rule that tripped
    (`consecutive` or `share`), `tripped_at` the log position of the session end that tripped
    it, the counts what the rule saw, `by_reason` the counted failures by reason, `last_errors`
    the last few of each reason (session id and message), `breaker` the rule's settings."""

    TYPE: ClassVar[str] = "BreakerTripped"
    rule: str
    tripped_at: int
    consecutive: int = 0
    window_failures: int = 0
    window_sessions: int = 0
    by_reason: dict[str, Any] = field(default_factory=dict)
    last_errors: dict[str, Any] = field(default_factory=dict)
    breaker: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadsPruned(Event):
    """Token payloads of settled, consumed steps were pruned (`sessions.runs.retention`), in the
    run's own stream (`@run:<run>`). Each pruned event keeps its payload's length and SHA-256 in
    a tombstone in place of the payload; `digest` is the SHA-256 over those tombstones in
    position order, `events` and `bytes` count them. The steps' queue rows are dropped."""

    TYPE: ClassVar[str] = "PayloadsPruned"
    prune_id: str
    partition: str
    steps: list[int] = field(default_factory=list)
    events: int = 0
    bytes: int = 0
    digest: str = ""
    bound: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCancelled(Event):
    TYPE: ClassVar[str] = "SessionCancelled"
    message: str | None = None


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls
    for cls in (
        SessionCreated,
        SessionStarted,
        TrajectoryRecorded,
        ModelCallStarted,
        ModelCallRecorded,
        ModelCallFailed,
        RewardPosted,
        SessionSucceeded,
        AttemptFailed,
        SessionFailed,
        PlaceholderEmitted,
        SessionCancelled,
        RunConfigured,
        PayloadsPruned,
        RunLaunched,
        BreakerTripped,
    )
}
TERMINAL_EVENTS = frozenset({"SessionSucceeded", "SessionFailed", "SessionCancelled"})
#: The event types of a run's own stream (`@run:<run>`): never a session's.
RUN_STREAM_EVENTS = frozenset({"RunConfigured", "PayloadsPruned", "RunLaunched", "BreakerTripped"})


def _data_function(cls: type[Event]) -> Callable[[Event], dict[str, Any]]:
    """`cls.to_data` as one dict display of its fields: the recorder calls it for every event it
    appends, and a display is a third of the time of a comprehension over `getattr`."""
    names = [name for name in _field_names(cls) if name not in cls.DATA_EXCLUDED]
    assert all(name.isidentifier() for name in names)
    items = ", ".join(f"{name!r}: self.{name}" for name in names)
    namespace: dict[str, Any] = {}
    exec(f"def to_data(self):\n    return {{{items}}}", namespace)  # noqa: S102 - field names only
    function = namespace["to_data"]
    function.__qualname__ = f"{cls.__name__}.to_data"
    function.__doc__ = Event.to_data.__doc__
    return function  # type: ignore[no-any-return]


for _cls in EVENT_TYPES.values():
    _cls.to_data = _data_function(_cls)  # type: ignore[method-assign]

_Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
#: An upcaster that also reads the event's binary payload (None when the reader did not load it).
_PayloadUpcaster = Callable[[dict[str, Any], "bytes | None"], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _WithPayload:
    """Registry entry of an upcaster registered with `with_payload=True`."""

    fn: _PayloadUpcaster

    def __call__(self, data: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
        return self.fn(data, payload)


#: (type, from_version) -> function lifting data from that version to from_version + 1.
UPCASTERS: dict[tuple[str, int], _Upcaster | _WithPayload] = {}


def upcaster(
    event_type: str, from_version: int, *, with_payload: bool = False
) -> Callable[[Any], Any]:
    """Register a function that lifts `event_type` data from `from_version` to the next version.

    The function gets a copy of the data (it may change it in place) and returns the new data.
    With `with_payload=True` it is called as `fn(data, payload)`: for fields derived from the
    token arrays. `payload` is None when the reader skipped payloads (the projector reads pages
    without them), so such an upcaster must then fill the field with a value meaning "unknown" —
    and no reader that skips payloads may depend on that field.
    """

    def register(fn: Any) -> Any:
        UPCASTERS[(event_type, from_version)] = _WithPayload(fn) if with_payload else fn
        return fn

    return register


def _count_trainable(
    payload: bytes | None, prompt_len: int, response_len: int, has_logprobs: bool
) -> int | None:
    """Tokens with response_mask == 1 in a trajectory payload; None if it is absent or malformed."""
    if payload is None:
        return None
    from sessions import tokens  # numpy, loaded only when token arrays are read (issue 28)

    try:
        arrays = tokens.decode(payload, prompt_len, response_len, has_logprobs)
    except ValueError:
        return None  # a damaged payload is the audit's to report, not the upcaster's
    return int((arrays.response_mask == 1).sum())


@upcaster("TrajectoryRecorded", 1, with_payload=True)
def _trajectory_v1_to_v2(data: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
    """v2 added `trainable_tokens`: counted from the payload's mask when the reader has it."""
    data["trainable_tokens"] = _count_trainable(
        payload, int(data["prompt_len"]), int(data["response_len"]), bool(data["has_logprobs"])
    )
    return data


@upcaster("TrajectoryRecorded", 2)
def _trajectory_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 recorded the weights versions and the calls a row was made from: a v2 trajectory was
    handed over whole, its versions unknown."""
    data["min_version"] = None
    data["max_version"] = None
    data["from_calls"] = []
    return data


@upcaster("SessionCreated", 1)
def _created_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 recorded the launch that created the session; before it, none was recorded."""
    data["launch"] = None
    return data


@upcaster("SessionFailed", 1)
def _failed_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 recorded the failure's origin and metric policy; a v1 failure had the defaults then in force."""
    data["origin"] = DEFAULT_ORIGINS.get(data.get("reason"), POLICY)  # type: ignore[arg-type]
    data["metric"] = ZERO
    data["selected"] = []
    data["score"] = None
    return data


@upcaster("SessionFailed", 2)
def _failed_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 recorded the retry budget that refused a retry; before it, no budget existed."""
    data["retry_refused"] = None
    return data


@upcaster("PlaceholderEmitted", 1)
def _placeholder_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 recorded the placeholder's lengths; every v1 placeholder was 1 + 1 tokens."""
    data["prompt_len"] = 1
    data["response_len"] = 1
    return data


@dataclass(frozen=True, slots=True)
class Recorded:
    """An event with its envelope, as read from (or about to go to) the log."""

    event: Event
    event_id: str
    session_id: str
    version: int
    recorded_at: datetime
    position: int | None = None

    @property
    def type(self) -> str:
        return self.event.TYPE


def upcast(
    event_type: str, schema_version: int, data: dict[str, Any], payload: bytes | None = None
) -> dict[str, Any]:
    """`data` of `event_type` at `schema_version`, lifted to the current schema (never mutated).

    `payload` is the event's binary payload, for upcasters registered `with_payload`; pass None
    when it was not read (those upcasters then fill "unknown").
    """
    cls = EVENT_TYPES.get(event_type)
    if cls is None:
        raise UnknownEventError(
            f"unknown event type {event_type!r} (schema_version {schema_version}): this log was written by "
            "another version of rollout-ledger; upgrade the package to read it"
        )
    if schema_version > cls.SCHEMA_VERSION:
        raise UnknownEventError(
            f"event type {event_type!r} has schema_version {schema_version}, newer than this library's "
            f"{cls.SCHEMA_VERSION}; upgrade rollout-ledger to read it"
        )
    version = schema_version
    while version < cls.SCHEMA_VERSION:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise UnknownEventError(
                f"event type {event_type!r} schema_version {version} has no upcaster to {version + 1} "
                f"(this library reads {event_type} up to schema_version {cls.SCHEMA_VERSION})"
            )
        try:
            data = step(dict(data), payload) if isinstance(step, _WithPayload) else step(dict(data))
        except (KeyError, TypeError, ValueError) as error:
            raise UnknownEventError(
                f"event type {event_type!r} schema_version {version} has malformed data: upcasting it to "
                f"{version + 1} failed ({type(error).__name__}: {error})"
            ) from error
        version += 1
    return data


def decode(stored: StoredEvent) -> Recorded:
    data = upcast(stored.type, stored.schema_version, stored.data, stored.payload)
    try:
        event = EVENT_TYPES[stored.type].from_data(data, stored.payload)
    except TypeError as error:
        raise UnknownEventError(
            f"event at position {stored.position} ({stored.type} v{stored.schema_version}) has malformed data: {error}"
        ) from error
    return Recorded(
        event,
        stored.event_id,
        stored.session_id,
        stored.version,
        stored.recorded_at,
        stored.position,
    )


def envelope(
    event: Event,
    *,
    session_id: str,
    version: int,
    run: str,
    uid: str,
    partition: str,
    global_step: int | None,
    recorded_at: datetime | None = None,
    data: dict[str, Any] | None = None,
) -> NewEvent:
    """Wrap a domain event for the store, with a fresh event id and a UTC timestamp (now, unless
    the caller passes one shared by all the events of a command); `data`: the event's
    `to_data()`, if the caller has it already."""
    return NewEvent(
        new_event_id(),
        session_id,
        version,
        event.TYPE,
        event.SCHEMA_VERSION,
        run,
        uid,
        partition,
        global_step,
        event.to_data() if data is None else data,  # encoded once, by NewEvent
        event.to_payload(),
        recorded_at or datetime.now(timezone.utc),
        slot=(event.session_index, event.group_size)  # the store checks it against the group
        if type(event) is SessionCreated
        else None,
    )


def new_event_id() -> str:
    """A version 7 UUID (RFC 9562) in canonical text form: 48 bits of Unix time in milliseconds,
    then 74 random bits.

    Time-ordered, not version 4: `uq_events_event_id` is a B-tree, and random keys sent every
    insert to a random leaf of it. At 10^6 events on PostgreSQL that made inserting a step's
    1,280 events 192-257 ms against 46-52 ms for ordered keys (issue 28); ids that begin with the
    clock land at the index's right edge. The random bits keep ids unique across processes.

    The recorder makes one per event, and a system call per id cost about 4 µs here, so the
    random bits are read from the OS for `_ID_BATCH` ids at a time (only the clock is read per
    id). A forked child drops its parent's unused random bits, so no two processes share them.
    """
    millis = f"{time.time_ns() // 1_000_000:012x}"
    while True:
        try:
            return f"{millis[:8]}-{millis[8:]}-{_unused_ids.pop()}"
        except IndexError:  # empty (another thread may have taken the last one): read more
            _unused_ids.extend(_random_tails(_ID_BATCH))


def _random_tails(count: int) -> list[str]:
    """`count` random UUID tails after the time: version 7, 12 bits, variant, 62 bits."""
    h = os.urandom(16 * count).hex()
    return [
        f"7{h[i + 13 : i + 16]}-{_VARIANT[h[i + 16]]}{h[i + 17 : i + 20]}-{h[i + 20 : i + 32]}"
        for i in range(0, 32 * count, 32)
    ]


#: Random tails read from the OS per system call (`new_event_id`).
_ID_BATCH = 256
_unused_ids: list[str] = []
os.register_at_fork(after_in_child=_unused_ids.clear)


#: RFC 4122 variant bits (10xx) applied to the first hex digit of the clock-seq field.
_VARIANT = {d: "89ab"[int(d, 16) & 3] for d in "0123456789abcdef"}
