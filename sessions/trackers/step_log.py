"""`log_step`: one settled step's metrics and failed-session sample, into every tracker, once.

Why a call after each step and not a projector sink: the projector commits pages, and a page
does not know whether it settled a step -- a sink would see a step's metric counts half-way
(groups still open), and a page retried after a crash is put again. The trainer knows when a
step is done; `log_step` then waits until the step is settled (as `Ledger.batch` does) and logs
what is final.

Each tracker remembers the steps it has logged (TensorBoard also in its log directory, so a
restarted trainer does not log a step twice); a step already logged is not logged again, and
the `LoggedStep` returned says, per tracker, what happened.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, runtime_checkable

from sessions.errors import (
    InvalidArgument,
    InvalidArgumentType,
    LedgerClosed,
    LedgerError,
    UsageError,
)
from sessions.trackers.content import FailedSession, StepContent, StepKey, collect_step

if TYPE_CHECKING:
    from sessions.ledger import Ledger
    from sessions.ledger.sync import SyncLedger

__all__ = [
    "ALREADY_LOGGED",
    "LOGGED",
    "LoggedStep",
    "MissingTrackerPackage",
    "Tracker",
    "log_step",
    "log_step_sync",
    "require",
]

log = logging.getLogger("sessions.trackers")
P = ParamSpec("P")

LOGGED = "logged"
#: Held while trackers are checked and written, so two calls for one step never both write it.
_WRITING = threading.Lock()
ALREADY_LOGGED = "already logged"


class MissingTrackerPackage(LedgerError, ImportError):
    """A tracker's package is not installed."""


def require(module: str, tracker: str) -> ModuleType:
    """Import a tracker's package on first use, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingTrackerPackage(
            f"{tracker} needs the `{module.split('.')[0]}` package, which could not be imported ({error}); "
            "install the trackers extra: pip install -e '.[trackers]' (from a clone of rollout-ledger)"
        ) from error


@runtime_checkable
class Tracker(Protocol):
    """Where a step's content goes. `write` returns "logged", or why nothing was written."""

    @property
    def name(self) -> str:
        """Which tracker and where (a log directory, a run id), for the report of a call."""

    def has_logged(self, key: StepKey) -> bool:
        """Whether this tracker already holds the step (then `log_step` leaves it alone)."""

    def write(
        self, content: StepContent, *, scalars: bool = True, failed_sessions: bool = True
    ) -> str:
        """Log the step: its scalars at `global_step`, and its failed-sessions table."""


@dataclass(frozen=True)
class LoggedStep:
    """What one `log_step` call did: the step, what it logged (`scalars`, `failed`), and per
    tracker (by name) "logged", "already logged" or why it was skipped."""

    run: str
    partition: str
    global_step: int | None
    scalars: dict[str, float] = field(default_factory=dict)
    failed: tuple[FailedSession, ...] = ()
    trackers: dict[str, str] = field(default_factory=dict)

    @property
    def logged(self) -> list[str]:
        """The trackers that wrote the step in this call."""
        return [name for name, status in self.trackers.items() if status == LOGGED]

    def __str__(self) -> str:
        where = (
            "; ".join(f"{name}: {status}" for name, status in self.trackers.items())
            or "no trackers"
        )
        what = (
            f"{len(self.scalars)} scalars and {len(self.failed)} failed-session samples"
            if self.logged
            else "nothing new"
        )
        return f"{self.partition} step {self.global_step} of run {self.run!r}: {what} ({where})"


async def log_step(
    ledger: Ledger,
    partition: str,
    global_step: int | None,
    *,
    trackers: Sequence[Tracker],
    run: str | None = None,
    timeout: float | None = 60.0,
    scalars: bool = True,
    failed_sessions: bool = True,
    per_reason: int = 3,
    max_failed: int = 20,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> LoggedStep:
    """Log one step of a `Ledger` (await it on the ledger's loop) into `trackers`, once each.

    Waits until the step is settled (`timeout` seconds, as `Ledger.metrics_dict`), then writes its
    scalars (verl's names and `ledger/...`; `scalars=False` if verl's own `Tracking` already logs
    `metrics_dict`) and a table of up to `per_reason` failed sessions of each reason
    (`max_failed` in all). A tracker that already has the step is skipped; the ledger is not even
    read when every tracker has it. `max_*_length`: verl's clip widths for the `train` figures.

    This signature is the one declaration of the options: `log_step_sync` takes the same.
    """
    _check_ledger(ledger, sync=False)  # before locals() is taken: it adds no name
    call = _StepLog.bind(ledger.run, **locals())  # the arguments as declared above
    pending, statuses = call.pending()
    if not pending:
        return _report(call.key, None, statuses)
    content = await collect_step(ledger, partition, global_step, **call.read)
    return call.write(content, pending, statuses)


def _check_ledger(ledger: object, *, sync: bool) -> None:
    """Refuse the wrong ledger before anything is read: `log_step` awaits a `Ledger` on its own
    loop, `log_step_sync` blocks on a `SyncLedger`."""
    from sessions.ledger import Ledger  # imported here: the module imports only for typing
    from sessions.ledger.sync import SyncLedger

    wanted, other = (
        (SyncLedger, "await log_step(ledger, ...)") if sync else (Ledger, "log_step_sync")
    )
    if not isinstance(ledger, wanted):
        raise InvalidArgumentType(
            f"log_step{'_sync' if sync else ''} takes a {wanted.__name__} (the other ledger goes "
            f"to {other}), got {type(ledger).__name__}",
            argument="ledger",
        )


def _face_of(
    original: Callable[Concatenate[Ledger, P], Awaitable[LoggedStep]],
) -> Callable[[Callable[..., LoggedStep]], Callable[Concatenate[SyncLedger, P], LoggedStep]]:
    """Give a `SyncLedger` face `original`'s parameters, declared once there: its signature (for
    `inspect` and `help`) and its type (for an editor), the ledger's type apart."""
    signature = inspect.signature(original)
    ledger, *rest = signature.parameters.values()
    face_signature = signature.replace(parameters=[ledger.replace(annotation="SyncLedger"), *rest])

    def give(face: Callable[..., LoggedStep]) -> Callable[Concatenate[SyncLedger, P], LoggedStep]:
        face.__signature__ = face_signature  # type: ignore[attr-defined]
        return face

    return give


@_face_of(log_step)
def log_step_sync(ledger: SyncLedger, *args: Any, **options: Any) -> LoggedStep:
    """`log_step` for a `SyncLedger` (verl's synchronous `fit`; any thread but the ledger's own),
    with `log_step`'s parameters: the step is read on the ledger's loop, the trackers are written
    in the calling thread, so their file and network I/O never stalls the ledger's recording."""
    _check_ledger(ledger, sync=True)
    if ledger.closed:
        raise LedgerClosed(
            "log_step_sync: the SyncLedger is closed; log each step before closing it"
        )
    call = _StepLog.bind(ledger.run, ledger, *args, **options)
    pending, statuses = call.pending()
    if not pending:
        return _report(call.key, None, statuses)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise UsageError(
            "log_step_sync blocks until the step is read, and was called inside a running event loop; "
            "there await log_step(sync_ledger.ledger, ...) on the ledger's own loop, or call log_step_sync from a thread"
        )
    _, partition, global_step = call.key
    coro = collect_step(ledger.ledger, partition, global_step, **call.read)
    reading = asyncio.run_coroutine_threadsafe(coro, ledger.loop)
    try:
        content = reading.result()  # bounded by `timeout`
    except BaseException:  # Ctrl-C here: stop the read on the ledger's loop too
        reading.cancel()
        raise
    return call.write(content, pending, statuses)


#: `log_step`'s parameters, and which of them `collect_step` takes (the read of the step).
_LOG_STEP = inspect.signature(log_step)
_READ = tuple(
    p.name
    for p in inspect.signature(collect_step).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


@dataclass(frozen=True)
class _StepLog:
    """One call of either face, its arguments bound to `log_step`'s signature (defaults filled):
    the step's key, the trackers and what to write, and the keywords of the step's read."""

    key: StepKey
    trackers: Sequence[Tracker]
    scalars: bool
    failed_sessions: bool
    read: dict[str, Any]

    @classmethod
    def bind(cls, ledger_run: str, *args: Any, **kwargs: Any) -> _StepLog:
        bound = _LOG_STEP.bind(*args, **kwargs)  # a wrong argument: TypeError, as for any call
        bound.apply_defaults()
        given = bound.arguments
        run = ledger_run if given["run"] is None else given["run"]
        return cls(
            (run, given["partition"], given["global_step"]),
            given["trackers"],
            given["scalars"],
            given["failed_sessions"],
            {name: given[name] for name in _READ},
        )

    def pending(self) -> tuple[list[Tracker], dict[str, str]]:
        """The trackers that lack the step, and a status per tracker in the order given."""
        _, pending, statuses = _pending(
            *self.key, self.trackers, self.scalars or self.failed_sessions
        )
        return pending, statuses

    def write(
        self, content: StepContent, pending: list[Tracker], statuses: dict[str, str]
    ) -> LoggedStep:
        return _write(
            content,
            pending,
            statuses,
            scalars=self.scalars,
            failed_sessions=self.failed_sessions,
        )


def _pending(
    run: str,
    partition: str,
    global_step: int | None,
    trackers: Sequence[Tracker],
    anything: bool,
) -> tuple[StepKey, list[Tracker], dict[str, str]]:
    """The step's key, the trackers that lack it, and a status per tracker in the order given."""
    if not anything:
        raise InvalidArgument(
            "log_step: scalars=False and failed_sessions=False would log nothing; keep one of them"
        )
    if isinstance(trackers, (str, bytes, Mapping)) or not isinstance(trackers, Sequence):
        raise InvalidArgumentType(
            f"log_step: trackers must be a list of trackers, got {trackers!r}", argument="trackers"
        )
    if not trackers:
        raise InvalidArgument(
            "log_step: no trackers given; pass trackers=[TensorBoardTracker(logdir), WandbTracker(...)]"
        )
    if global_step is None:
        raise InvalidArgument(
            "log_step: a tracker plots each figure against a step, and global_step is None; "
            "record the sessions with global_step=... to log them"
        )
    key: StepKey = (run, partition, global_step)
    statuses: dict[str, str] = {}
    pending = []
    for tracker in trackers:
        if not isinstance(tracker, Tracker):
            raise InvalidArgumentType(
                f"log_step: {tracker!r} is not a tracker (it needs name, has_logged and write)"
            )
        if tracker.has_logged(key):
            statuses[tracker.name] = ALREADY_LOGGED
        else:
            statuses[tracker.name] = "pending"  # replaced by what `write` says
            pending.append(tracker)
    return key, pending, statuses


def _write(
    content: StepContent,
    pending: list[Tracker],
    statuses: dict[str, str],
    *,
    scalars: bool,
    failed_sessions: bool,
) -> LoggedStep:
    """Write into each pending tracker that still lacks the step: asked again under the lock, since
    another call for the same step (a task, a thread) may have written it while this one read."""
    with _WRITING:
        for tracker in pending:
            if tracker.has_logged(content.key):
                statuses[tracker.name] = ALREADY_LOGGED
            else:
                statuses[tracker.name] = tracker.write(
                    content, scalars=scalars, failed_sessions=failed_sessions
                )
    return _report(
        content.key,
        content if scalars or failed_sessions else None,
        statuses,
        scalars=scalars,
        failed_sessions=failed_sessions,
    )


def _report(
    key: StepKey,
    content: StepContent | None,
    statuses: dict[str, str],
    *,
    scalars: bool = True,
    failed_sessions: bool = True,
) -> LoggedStep:
    run, partition, global_step = key
    done = LoggedStep(
        run,
        partition,
        global_step,
        scalars=dict(content.scalars) if content is not None and scalars else {},
        failed=tuple(content.failed) if content is not None and failed_sessions else (),
        trackers=dict(statuses),
    )
    log.info("rollout-ledger trackers: %s", done)
    return done
