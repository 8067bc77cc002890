# Generated from sessions/ledger/sync/faces.py by `python -m sessions.ledger.stubgen`: edit that, not this.
"""`SyncLedger`, `SyncSession` and `SessionProxy`, derived from `Ledger` and `SessionHandle`.

`derive` gives a face every public `async def` of its original as a method that runs it on the
ledger's loop (blocking, or awaitable from another loop), with the original's signature and
docstring, and every property read through; a `SessionHandle` a method returns comes back as the
face's session. `OWN` names what `SyncLedger` writes itself instead, and why. Editors read the
faces' types from `faces.pyi`, written by `python -m sessions.ledger.stubgen`."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from types import EllipsisType
from typing import Any, TypeVar

from typing_extensions import Unpack

from sessions import aggregate as agg
from sessions.failure_policy import RetryPolicy
from sessions.ledger.config import LedgerConfig, OpenOptions, RunSessionOptions, SessionOptions
from sessions.ledger.ledger import Ledger
from sessions.ledger.sync.loop_thread import Runtime
from sessions.projection.metrics import MetricRow
from sessions.recorder import SessionHandle, SessionOutcome

__all__ = ["OWN", "SessionProxy", "SyncLedger", "SyncSession", "derive"]

Face = TypeVar("Face", bound=type)

OWN: dict[str, str]

class SessionProxy:
    """A session's commands, awaitable from any event loop; each runs on the ledger's loop."""
    def __init__(self, owner: SyncLedger, handle: SessionHandle) -> None: ...
    @property
    def session_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def version(self) -> int:
        """The view's version: with staged commands, ahead of what is durable (`durable_version`)."""
    @property
    def durable_version(self) -> int:
        """The version the log is known to hold: `version` less the staged events."""
    @property
    def terminal(self) -> bool: ...
    @property
    def attempt(self) -> int:
        """The current attempt, 1-based (a runner may behave differently on a retry)."""
    @property
    def view(self) -> agg.SessionView:
        """The folded state (read-only by convention)."""
    async def start(self, *, attempt: int | None = None, timeout_s: float | None = None) -> None:
        """Start a session created with `start=False` (created -> running), or its next attempt
        after `retry` (retrying -> running)."""
    async def record_trajectory(
        self,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_mask: Any | None = None,
        response_logprobs: Any | None = None,
        num_turns: int = 1,
        materialization_reason: str | None = None,
        extra: dict[str, Any] | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
    ) -> int:
        """Record one trajectory; returns its index. Mask defaults to all 1 (every token
        trainable); `min_version` / `max_version`: the weights versions behind its response."""
    async def start_call(
        self,
        call_id: str | None = None,
        *,
        turn: int | None = None,
        sampling: dict[str, Any] | None = None,
        version: int | None = None,
    ) -> str:
        """Record a model call's intent before the request leaves; returns its id (`c<n>`, the
        attempt's n-th call, when none is given). `turn`: the conversation turn (default: the
        attempt's count of calls so far); `version`: the weights version asked for, if known.
        A call left without `record_call` or `fail_call` fails the session closed at `complete`."""
    async def record_call(
        self,
        call_id: str,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_logprobs: Any | None = None,
        finish_reason: str | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        latency_s: float | None = None,
        server: str | None = None,
        text: str | None = None,
    ) -> None:
        """Record a started call's answer, before the caller hands it on: the whole prompt as
        sent (only what it adds to the previous call's context is stored), the response, its
        log-probs, and the weights versions that served it (one version: pass it as both, or as
        either). The session's row is assembled from its recorded calls at `complete`."""
    async def fail_call(
        self,
        call_id: str,
        error: BaseException | None = None,
        *,
        message: str = "",
        error_type: str | None = None,
        latency_s: float | None = None,
    ) -> None:
        """Record that a started call ended without an answer (`error`, or `message` and
        `error_type`): the call is settled and none of its tokens reach a row."""
    async def post_reward(self, reward: float | None, **info: Any) -> None:
        """Post the reward (None = absent) and diagnostics; info merges into reward_info by key."""
    async def complete(
        self,
        *,
        score: float | None = None,
        trajectory_selection: str | None = None,
    ) -> str:
        """End the session: `succeeded`, or `failed`/`empty_output` without a trajectory. Returns the state."""
    async def fail(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_refused: str | None = None,
    ) -> None:
        """End the session as failed; `origin` (`infra`/`policy`) overrides the reason's default;
        `retry_refused` names the retry budget that refused the retry the policy would have made
        (`RetryPolicy.group_budget` / `step_budget`)."""
    async def fail_with(self, error: BaseException) -> None:
        """Fail the session because `error` was raised inside it, whatever it is: its reason,
        origin and text as `recorded_failure` makes them storable."""
    async def retry(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_in_s: float = 0.0,
    ) -> None:
        """End the current attempt as failed and superseded (running -> retrying); `start()`
        begins the next. `Ledger.run_session(retry=...)` does this for you."""
    async def retry_with(self, error: BaseException, *, retry_in_s: float = 0.0) -> None:
        """`retry` because `error` was raised inside the attempt (made storable as in `fail_with`)."""
    async def cancel(self, message: str | None = None) -> None:
        """End the session as cancelled, `message` saying why: a pure abort, which leaves no row
        (no placeholder) and lets its group settle."""
    async def flush(self) -> None:
        """Append the staged commands now (a no-op when none is staged): for a caller that must
        know they are durable before it goes on."""

class SyncLedger:
    """A `Ledger` on an event loop thread of its own, for synchronous code and other loops.

    Use `SyncLedger.open(...)` (also a context manager); `close()` when done. Thread-safe: any
    number of threads and event loops may call it at once. Each `Ledger` call is here blocking
    (`batch`) and awaitable from another loop (`abatch`), with its parameters."""
    def __init__(self, runtime: Runtime, call_timeout: float | None) -> None: ...
    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        migrate: bool = True,
        settings: LedgerConfig | None = None,
        call_timeout: float | None = None,
        open_timeout: float | None = 300.0,
        **options: Unpack[OpenOptions],
    ) -> SyncLedger:
        """Open the database at `url` as `Ledger.open(url, migrate=..., settings=..., **options)`
        would, on a new loop thread; the options are checked first, in the calling thread.

        `call_timeout`: seconds any blocking call may wait before it is cancelled and raises
        `LedgerTimeout` (None: no limit beyond each call's own, e.g. `batch(timeout=...)`);
        `open_timeout`: seconds the database may take to open."""
    def __enter__(self) -> SyncLedger: ...
    def __exit__(self, *exc: object) -> None: ...
    def close(self) -> None:
        """Cancel calls still under way, close the ledger, stop and join its thread. Idempotent."""
    @property
    def closed(self) -> bool:
        """Whether `close()` has run: every call after it raises `LedgerClosed`."""
    @property
    def ledger(self) -> Ledger:
        """The async `Ledger` inside; await its methods only on `loop` (e.g. in a sink)."""
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the ledger runs on, in the thread this face owns."""
    @property
    def run(self) -> str:
        """The ledger's run (`LedgerConfig.run`)."""
    @contextlib.contextmanager
    def session(self, session_id: str, **identity: Unpack[SessionOptions]) -> Iterator[SyncSession]:
        """`Ledger.session` for synchronous code, exiting exactly as it does (it runs on the loop):
        normal exit completes the session; an Exception fails it (TimeoutError: reason timeout) and
        re-raises; KeyboardInterrupt / SystemExit cancel it and re-raise."""
    @contextlib.asynccontextmanager
    def asession(
        self,
        session_id: str,
        **identity: Unpack[SessionOptions],
    ) -> AsyncIterator[SessionProxy]:
        """`Ledger.session` for another event loop; exits exactly as it does (cancellation cancels)."""
    def run_session(
        self,
        runner: Callable[[SessionProxy], Awaitable[Any]],
        session_id: str,
        /,
        *,
        timeout: float | None = None,
        recording_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        **identity: Unpack[RunSessionOptions],
    ) -> SessionOutcome:
        """`Ledger.run_session` for synchronous code: the async `runner(session)` runs on a loop of
        its own in this thread (never on the ledger's)."""
    async def arun_session(
        self,
        runner: Callable[[SessionProxy], Awaitable[Any]],
        session_id: str,
        /,
        *,
        timeout: float | None = None,
        recording_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        **identity: Unpack[RunSessionOptions],
    ) -> SessionOutcome:
        """`Ledger.run_session` from another event loop: `runner(session)` runs on the caller's loop,
        its commands on the ledger's; timeouts, failures and cancellation end the session as there."""
    def create_session(
        self,
        session_id: str,
        *,
        uid: str,
        session_index: int,
        group_size: int,
        partition: str,
        global_step: int | None = None,
        run: str | None = None,
        data_source: str | None = None,
        runner: str | None = None,
        sample_index: int | None = None,
        metadata: dict[str, Any] | None = None,
        attempt: int | None = None,
        timeout_s: float | None = None,
        start: bool = True,
    ) -> SyncSession:
        """Append SessionCreated (and SessionStarted unless start=False) in one atomic append."""
    async def acreate_session(
        self,
        session_id: str,
        *,
        uid: str,
        session_index: int,
        group_size: int,
        partition: str,
        global_step: int | None = None,
        run: str | None = None,
        data_source: str | None = None,
        runner: str | None = None,
        sample_index: int | None = None,
        metadata: dict[str, Any] | None = None,
        attempt: int | None = None,
        timeout_s: float | None = None,
        start: bool = True,
    ) -> SessionProxy:
        """Append SessionCreated (and SessionStarted unless start=False) in one atomic append."""
    def load_session(self, session_id: str) -> SyncSession:
        """A handle on an existing session, folded from its events (e.g. to fail an orphan)."""
    async def aload_session(self, session_id: str) -> SessionProxy:
        """A handle on an existing session, folded from its events (e.g. to fail an orphan)."""
    def begin_launch(self, launch: str) -> int:
        """Record from now on as launch `launch` of the job (docs/design.md §14): for an adapter
        that learns the launch after the ledger was opened (TRL's rank-0 token). The ledger's run
        records it (or reads it back, when another process of the launch did) and, if this call
        recorded a resume, fails the earlier launches' open sessions; every session created after
        carries its number. Returns that number in the ledger's run."""
    async def abegin_launch(self, launch: str) -> int:
        """Record from now on as launch `launch` of the job (docs/design.md §14): for an adapter
        that learns the launch after the ledger was opened (TRL's rank-0 token). The ledger's run
        records it (or reads it back, when another process of the launch did) and, if this call
        recorded a resume, fails the earlier launches' open sessions; every session created after
        carries its number. Returns that number in the ledger's run."""
    def project(self) -> int:
        """Project the log to its current end; returns the number of events projected."""
    async def aproject(self) -> int:
        """Project the log to its current end; returns the number of events projected."""
    def batch(
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        jagged: bool = False,
        pad_token_id: int = 0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_width: int | None = None,
        response_width: int | None = None,
        truncate: bool = False,
        poll_interval: float = 0.5,
        reward_info: bool = False,
        logprobs: bool | None = None,
        max_staleness: int | None = None,
    ) -> Any:
        """The step's batch (a TensorDict) once every group of the step is settled.

        Projects as it waits. Raises `StepNotSettled` (a `TimeoutError`) naming the unsettled
        groups after `timeout` seconds (None waits forever): a group that never settles is a
        session someone must fail or cancel (see `recover`), not a reason to hang.
        `prompt_width`/`response_width` pad the padded layout to exactly those widths (verl's
        `max_prompt_length` / `max_response_length`), so the batches of every step concatenate; a
        longer row is an error unless `truncate`. `reward_info=True` adds a non-tensor column per
        key the rows' posted `reward_info` carries, filled on every row
        (`sessions.batches.reward_info`: a placeholder gets 0.0 for a numeric key), which
        `to_data_proto` names verl's `reward_extra_keys`. `logprobs=True` gives the padded batch a
        `rollout_log_probs` column even when no row carries log-probs (an empty step's batch then
        concatenates with a normal one); `False` leaves it out; None: only when a row has them.
        `max_staleness=k` leaves out the rows whose oldest token came from weights more than `k`
        steps behind the policy being trained (`sessions.projection.staleness`; rows of unknown
        version are kept), logged with their count and share; `metrics_dict(...,
        max_staleness=k)` reports the same rows under `ledger/<partition>/all/left_out/stale`."""
    async def abatch(
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        jagged: bool = False,
        pad_token_id: int = 0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        prompt_width: int | None = None,
        response_width: int | None = None,
        truncate: bool = False,
        poll_interval: float = 0.5,
        reward_info: bool = False,
        logprobs: bool | None = None,
        max_staleness: int | None = None,
    ) -> Any:
        """The step's batch (a TensorDict) once every group of the step is settled.

        Projects as it waits. Raises `StepNotSettled` (a `TimeoutError`) naming the unsettled
        groups after `timeout` seconds (None waits forever): a group that never settles is a
        session someone must fail or cancel (see `recover`), not a reason to hang.
        `prompt_width`/`response_width` pad the padded layout to exactly those widths (verl's
        `max_prompt_length` / `max_response_length`), so the batches of every step concatenate; a
        longer row is an error unless `truncate`. `reward_info=True` adds a non-tensor column per
        key the rows' posted `reward_info` carries, filled on every row
        (`sessions.batches.reward_info`: a placeholder gets 0.0 for a numeric key), which
        `to_data_proto` names verl's `reward_extra_keys`. `logprobs=True` gives the padded batch a
        `rollout_log_probs` column even when no row carries log-probs (an empty step's batch then
        concatenates with a normal one); `False` leaves it out; None: only when a row has them.
        `max_staleness=k` leaves out the rows whose oldest token came from weights more than `k`
        steps behind the policy being trained (`sessions.projection.staleness`; rows of unknown
        version are kept), logged with their count and share; `metrics_dict(...,
        max_staleness=k)` reports the same rows under `ledger/<partition>/all/left_out/stale`."""
    def metrics_dict(
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        poll_interval: float = 0.5,
        max_staleness: int | None = None,
    ) -> dict[str, float]:
        """One flat dict for an experiment tracker (verl's `Tracking.log(data=..., step=...)`).

        Once the step is settled (as `batch` waits): verl's own names and numbers computed from
        the rows the step's batch holds -- `val`: `val-core/<ds>/reward/mean@N`, `best@N/...`,
        `val-aux/...` as verl's `process_validation_metrics` and `_val_metrics_update` give them;
        `train`: the batch-only parts of `compute_data_metrics` (`critic/score/*`,
        `response_length/*`, ...) -- plus every one of the ledger's metric counts under
        `ledger/<partition>/<data_source or all>/<metric>`. `max_*_length` are verl's clip
        thresholds for the `clip_ratio` figures of `train`. `max_staleness`: as `batch`'s, the
        figures are those of the rows it keeps, and the rows left out are counted. What the
        step's failures cost is under `ledger/<partition>/all/cost/` (`sessions.projection.costs`)."""
    async def ametrics_dict(
        self,
        partition: str,
        global_step: int | None,
        *,
        run: str | None = None,
        timeout: float | None = 60.0,
        max_prompt_length: int | None = None,
        max_response_length: int | None = None,
        poll_interval: float = 0.5,
        max_staleness: int | None = None,
    ) -> dict[str, float]:
        """One flat dict for an experiment tracker (verl's `Tracking.log(data=..., step=...)`).

        Once the step is settled (as `batch` waits): verl's own names and numbers computed from
        the rows the step's batch holds -- `val`: `val-core/<ds>/reward/mean@N`, `best@N/...`,
        `val-aux/...` as verl's `process_validation_metrics` and `_val_metrics_update` give them;
        `train`: the batch-only parts of `compute_data_metrics` (`critic/score/*`,
        `response_length/*`, ...) -- plus every one of the ledger's metric counts under
        `ledger/<partition>/<data_source or all>/<metric>`. `max_*_length` are verl's clip
        thresholds for the `clip_ratio` figures of `train`. `max_staleness`: as `batch`'s, the
        figures are those of the rows it keeps, and the rows left out are counted. What the
        step's failures cost is under `ledger/<partition>/all/cost/` (`sessions.projection.costs`)."""
    def metrics(
        self,
        partition: str | None = None,
        global_step: int | None | EllipsisType = ...,
        *,
        run: str | None = None,
        project: bool = True,
    ) -> list[MetricRow]:
        """Metric counts of a run (default: this ledger's), optionally one partition and step.

        `global_step`: `...` (default) every step; an integer that step; None only the rows of
        sessions recorded without a step."""
    async def ametrics(
        self,
        partition: str | None = None,
        global_step: int | None | EllipsisType = ...,
        *,
        run: str | None = None,
        project: bool = True,
    ) -> list[MetricRow]:
        """Metric counts of a run (default: this ledger's), optionally one partition and step.

        `global_step`: `...` (default) every step; an integer that step; None only the rows of
        sessions recorded without a step."""

class SyncSession:
    """A session's commands as blocking calls, each `SessionHandle`'s run on the ledger's loop."""
    def __init__(self, owner: SyncLedger, handle: SessionHandle) -> None: ...
    @property
    def session_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def version(self) -> int:
        """The view's version: with staged commands, ahead of what is durable (`durable_version`)."""
    @property
    def durable_version(self) -> int:
        """The version the log is known to hold: `version` less the staged events."""
    @property
    def terminal(self) -> bool: ...
    @property
    def attempt(self) -> int:
        """The current attempt, 1-based (a runner may behave differently on a retry)."""
    @property
    def view(self) -> agg.SessionView:
        """The folded state (read-only by convention)."""
    def start(self, *, attempt: int | None = None, timeout_s: float | None = None) -> None:
        """Start a session created with `start=False` (created -> running), or its next attempt
        after `retry` (retrying -> running)."""
    def record_trajectory(
        self,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_mask: Any | None = None,
        response_logprobs: Any | None = None,
        num_turns: int = 1,
        materialization_reason: str | None = None,
        extra: dict[str, Any] | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
    ) -> int:
        """Record one trajectory; returns its index. Mask defaults to all 1 (every token
        trainable); `min_version` / `max_version`: the weights versions behind its response."""
    def start_call(
        self,
        call_id: str | None = None,
        *,
        turn: int | None = None,
        sampling: dict[str, Any] | None = None,
        version: int | None = None,
    ) -> str:
        """Record a model call's intent before the request leaves; returns its id (`c<n>`, the
        attempt's n-th call, when none is given). `turn`: the conversation turn (default: the
        attempt's count of calls so far); `version`: the weights version asked for, if known.
        A call left without `record_call` or `fail_call` fails the session closed at `complete`."""
    def record_call(
        self,
        call_id: str,
        *,
        prompt_ids: Any,
        response_ids: Any,
        response_logprobs: Any | None = None,
        finish_reason: str | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        latency_s: float | None = None,
        server: str | None = None,
        text: str | None = None,
    ) -> None:
        """Record a started call's answer, before the caller hands it on: the whole prompt as
        sent (only what it adds to the previous call's context is stored), the response, its
        log-probs, and the weights versions that served it (one version: pass it as both, or as
        either). The session's row is assembled from its recorded calls at `complete`."""
    def fail_call(
        self,
        call_id: str,
        error: BaseException | None = None,
        *,
        message: str = "",
        error_type: str | None = None,
        latency_s: float | None = None,
    ) -> None:
        """Record that a started call ended without an answer (`error`, or `message` and
        `error_type`): the call is settled and none of its tokens reach a row."""
    def post_reward(self, reward: float | None, **info: Any) -> None:
        """Post the reward (None = absent) and diagnostics; info merges into reward_info by key."""
    def complete(
        self,
        *,
        score: float | None = None,
        trajectory_selection: str | None = None,
    ) -> str:
        """End the session: `succeeded`, or `failed`/`empty_output` without a trajectory. Returns the state."""
    def fail(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_refused: str | None = None,
    ) -> None:
        """End the session as failed; `origin` (`infra`/`policy`) overrides the reason's default;
        `retry_refused` names the retry budget that refused the retry the policy would have made
        (`RetryPolicy.group_budget` / `step_budget`)."""
    def fail_with(self, error: BaseException) -> None:
        """Fail the session because `error` was raised inside it, whatever it is: its reason,
        origin and text as `recorded_failure` makes them storable."""
    def retry(
        self,
        reason: str = "runner_error",
        *,
        message: str = "",
        error_type: str | None = None,
        origin: str | None = None,
        retry_in_s: float = 0.0,
    ) -> None:
        """End the current attempt as failed and superseded (running -> retrying); `start()`
        begins the next. `Ledger.run_session(retry=...)` does this for you."""
    def retry_with(self, error: BaseException, *, retry_in_s: float = 0.0) -> None:
        """`retry` because `error` was raised inside the attempt (made storable as in `fail_with`)."""
    def cancel(self, message: str | None = None) -> None:
        """End the session as cancelled, `message` saying why: a pure abort, which leaves no row
        (no placeholder) and lets its group settle."""
    def flush(self) -> None:
        """Append the staged commands now (a no-op when none is staged): for a caller that must
        know they are durable before it goes on."""

def derive(
    original: type,
    *,
    blocking: bool = True,
    awaitable: str | None = None,
    own: Collection[str] = ...,
) -> Callable[[Face], Face]:
    """A class decorator: the face gets each public `async def` of `original` not in `own` as a
    blocking method (`blocking`) and as an awaitable one named `awaitable + name` (`awaitable` not
    None), and each property read through. The face's `_target` is the original object, its
    `_owner` the `SyncLedger` whose loop runs the calls."""
