"""`Ledger`: the embedded entry point — open a database, record sessions, project, read batches."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from types import EllipsisType
from typing import TYPE_CHECKING, Any

from sessions import aggregate as agg
from sessions import events as ev
from sessions import validation, vocabulary
from sessions.errors import (
    ConcurrencyError,
    ConfigError,
    InvalidArgument,
    InvalidArgumentType,
    InvalidInput,
    RunHalted,
    StepNotSettled,
    UsageError,
)
from sessions.failure_policy import GROUP_BUDGET, STEP_BUDGET, RetryPolicy
from sessions.ledger.attempts import (
    Deadline,
    LoopBlocks,
    Runner,
    run_attempts,
    settle_or_note,
)
from sessions.ledger.config import (
    DEFAULT_RUN,
    ENGINE_OPTIONS,
    LedgerConfig,
    LedgerOptions,
    OpenOptions,
    RunSessionOptions,
    SessionOptions,
    resolve,
)
from sessions.projection import costs, staleness, verl_metrics
from sessions.projection.metrics import MetricRow
from sessions.projection.projector import Projector
from sessions.projection.settled import SettledStep, settled_step
from sessions.recorder import (
    SessionHandle,
    SessionOutcome,
    append_then_apply,
    storable_envelopes,
    stored_bytes,
)
from sessions.runs import fingerprint, launches
from sessions.runs.halts import RunWatch
from store import (
    OPEN_ATTEMPTS,
    AsyncEngine,
    EventStore,
    GroupConflict,
    StoredJSONError,
    check_schema,
    create_engine,
    deferred_cancel,
    normalize_url,
    retry_transient,
    upgrade,
)
from store import read_models as rm

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

logger = logging.getLogger(__name__)


async def _halt(watch: RunWatch) -> RunHalted | None:
    """The run's halt, looked up now (None while it runs)."""
    try:
        await watch.check(now=True)
    except RunHalted as halted:
        return halted
    return None


#: Seconds `run_session` waits, past the runner's timeout, for the session's end to be recorded.
RECORDING_TIMEOUT = 10.0


class Ledger:
    """One database, one event store, one set of failure policies. Use `Ledger.open(...)`."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        settings: LedgerConfig | None = None,
        **options: Unpack[LedgerOptions],
    ) -> None:
        """A ledger on `engine` with `settings` (a `LedgerConfig`) or its fields as keywords
        (`sessions.ledger.config`; keywords beside `settings` replace its fields)."""
        settings = resolve(settings, options)
        self.settings = settings
        self.engine = engine
        self.store = EventStore(engine)
        self.run = settings.run
        self.policy = settings.placeholder_policy
        self.metric_policy = settings.metric_policy
        self.retry_policy = settings.retry_policy
        self.min_valid = settings.min_valid
        self.resume = settings.resume
        self.trajectory_selection = settings.trajectory_selection
        #: what the run's fingerprint covers (`sessions.runs.fingerprint`)
        self.config = settings.fingerprinted()
        #: runs whose recorded configuration this ledger has checked (or is checking)
        self._configured: dict[str, asyncio.Future[None]] = {}
        #: this launch of the job (`sessions.runs.launches`), None to record no launches
        self.launch = settings.launch or launches.launch_from_environment()
        #: the launch's number in each run it writes to, once recorded (or read back)
        self._launch_numbers: dict[str, int] = {}
        #: each run's circuit breaker as this ledger follows it (`sessions.runs.halts`)
        self._watches: dict[str, RunWatch] = {}
        self.limits = settings.caps
        self.projector = Projector(engine, sinks=settings.sinks, store=self.store)
        #: `run_session` work whose recording outlived its call (see `recording_timeout`).
        self._recording: set[asyncio.Future[SessionOutcome]] = set()
        #: runner steps that blocked this ledger's event loop, named in the timeouts they caused
        self._loop_blocks = LoopBlocks()
        #: the event loop the ledger serves: its engine's pooled connections and its store's
        #: group-commit worker belong to it (set on first use)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _own_loop(self) -> None:
        """Refuse a call from another event loop with one clear error: there a pooled connection
        fails with "attached to a different loop" and poisons the pool for the owner loop too."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            state = "closed" if self._loop.is_closed() else "still running"
            raise UsageError(
                f"this Ledger was opened on another event loop ({state}); its connections and "
                "group-commit worker serve that loop only — open a Ledger in this loop, or use "
                "sessions.SyncLedger, which any thread or event loop can share"
            )

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str | None = None,
        *,
        migrate: bool = True,
        settings: LedgerConfig | None = None,
        **options: Unpack[OpenOptions],
    ) -> AsyncIterator[Ledger]:
        """Open (and by default migrate) the database at `url`; a bare path means a SQLite file.

        The ledger's options are `settings` (a `LedgerConfig`: run, failure policies, `config`
        and `resume` for the run's fingerprint, size caps, sinks) or its fields as keywords;
        keywords beside `settings` replace its fields. They are checked before the database is
        touched (`ConfigError`). Passing `config` or `resume` checks the run's fingerprint at
        open; otherwise at the ledger's first session of the run. `sqlite_busy_timeout`,
        `require_ledger`, `engine_options` and `share_database` go to the engine and its migration
        (`sessions.ledger.config.EngineOptions`).
        """
        engine_options = {key: options.pop(key) for key in ENGINE_OPTIONS & options.keys()}
        settings = resolve(settings, options)
        engine = create_engine(
            normalize_url(url),
            sqlite_busy_timeout=engine_options.get("sqlite_busy_timeout"),
            require_ledger=bool(engine_options.get("require_ledger", False)),
            **dict(engine_options.get("engine_options") or {}),
        )
        try:
            # A connection dropped while opening (a PostgreSQL restart) is retried, longer than a command.
            share = bool(engine_options.get("share_database"))
            ready = partial(upgrade, engine, share=share)
            ready = ready if migrate else partial(check_schema, engine)
            # A server that refuses the connection (not up yet, restarting) is retried as long,
            # then named in a DatabaseUnreachableError with what to check.
            await retry_transient(
                ready,
                what=f"open (migrate={migrate})",
                attempts=OPEN_ATTEMPTS,
                connecting=engine.url,
            )
            ledger = cls(engine, settings=settings)
            ledger._loop = asyncio.get_running_loop()
            try:
                if (
                    settings.config is not None
                    or settings.resume is not None
                    or ledger.launch is not None
                ):  # a launch is recorded at open, so the earlier launch's orphans fail at once
                    await ledger._ensure_configured(ledger.run)
                yield ledger
            finally:
                await ledger.close()
        finally:
            await engine.dispose()

    async def close(self) -> None:
        """Close the store once recordings still under way in the background have landed (each
        within its own retry budget; see `run_session`)."""
        if self._recording:
            await asyncio.wait(set(self._recording))
        await self.store.close()

    # ------------------------------------------------------------- sessions
    async def create_session(
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
    ) -> SessionHandle:
        """Append SessionCreated (and SessionStarted unless start=False) in one atomic append."""
        self._own_loop()
        run = self.run if run is None else run
        validation.check_identity(
            session_id,
            run=run,
            uid=uid,
            session_index=session_index,
            group_size=group_size,
            partition=partition,
            global_step=global_step,
        )
        metadata = validation.json_dict(session_id, "metadata", metadata)
        data_source = vocabulary.check_data_source(data_source, session_id=session_id)
        runner = vocabulary.check_label(runner, "runner", session_id=session_id)
        view = agg.SessionView(session_id)
        decided: list[ev.Event] = [
            ev.SessionCreated(
                run=run,
                uid=uid,
                session_index=int(session_index),
                group_size=int(group_size),
                partition=partition,
                global_step=None if global_step is None else int(global_step),
                data_source=data_source,
                runner=runner,
                sample_index=sample_index,
                metadata=metadata,
                min_valid=None if self.min_valid == ev.DEFAULT_MIN_VALID else self.min_valid,
                launch=self._launch_numbers.get(run),
            )
        ]
        if start:
            decided.append(ev.SessionStarted(attempt=attempt, timeout_s=timeout_s))
        decided, envelopes = storable_envelopes(
            decided,
            session_id=session_id,
            version=0,
            run=run,
            uid=uid,
            partition=partition,
            global_step=global_step,
        )
        size = self.limits.check(session_id, "metadata", 0, 0, envelopes)
        # The run's configuration is checked (recorded, the first time) once the session's own
        # input passed: a refused session writes nothing. A cancellation meanwhile still creates
        # the session and records it cancelled (as one during the creation append does), so its
        # group settles.
        # A halted run creates no session (`RunHalted`); those in flight settle as they would.
        cancelled = False
        try:
            await self._ensure_configured(run)
            await self._watch(run).check()
        except asyncio.CancelledError:
            cancelled = True
            await asyncio.shield(self._ensure_configured(run))
        number = self._launch_numbers.get(run)
        if number is not None and getattr(decided[0], "launch", None) != number:
            # the run's launch was recorded just now, by the check above: the creation carries it
            decided, envelopes = storable_envelopes(
                [dataclasses.replace(decided[0], launch=number), *decided[1:]],
                session_id=session_id,
                version=0,
                run=run,
                uid=uid,
                partition=partition,
                global_step=global_step,
            )
            size = self.limits.check(session_id, "metadata", 0, 0, envelopes)
        handle = self._handle(view, size)
        try:
            if cancelled:
                await asyncio.shield(append_then_apply(self.store, view, decided, envelopes))
                raise asyncio.CancelledError
            await append_then_apply(self.store, view, decided, envelopes)
        except ConcurrencyError:
            raise InvalidInput(
                session_id,
                "session_id",
                "already exists in this database; session ids must be unique — use a fresh id",
            ) from None
        except GroupConflict as conflict:
            raise InvalidInput(conflict.session_id, conflict.field, conflict.problem) from None
        except asyncio.CancelledError:
            if view.state != agg.NEW:  # created, then cancelled before the caller got the handle
                await asyncio.shield(handle.cancel("cancelled while being created"))
            raise
        return handle

    async def load_session(self, session_id: str) -> SessionHandle:
        """A handle on an existing session, folded from its events (e.g. to fail an orphan)."""
        self._own_loop()
        vocabulary.check_session_id(session_id)
        try:
            stored = await self.store.read_stream(session_id)
        except StoredJSONError as error:
            raise StoredJSONError(f"session {session_id!r}: {error}") from error
        if not stored:
            raise InvalidInput(session_id, "session_id", "no such session in this database")
        view = agg.fold(session_id, (ev.decode(s).event for s in stored))
        return self._handle(view, stored_bytes(stored))

    def _handle(self, view: agg.SessionView, size: int) -> SessionHandle:
        return SessionHandle(
            self.store,
            view,
            self.policy,
            self.trajectory_selection,
            limits=self.limits,
            stored_bytes=size,
            metrics=self.metric_policy,
            on_failed=self._session_failed,
        )

    def _session_failed(self, run: str) -> None:
        watch = self._watches.get(run)
        if watch is not None:
            watch.look_soon()

    async def _ensure_configured(self, run: str) -> None:
        """Check (once per run) that `run` was recorded with this ledger's configuration, or
        record it; concurrent first sessions wait for the one check."""
        check = self._configured.get(run)
        if check is None:  # one future for every waiter, not a shield each (store.futures says why)
            check = self._configured[run] = deferred_cancel(
                asyncio.ensure_future(self._configure(run))
            )
        try:
            await check
        except BaseException:
            if check.done() and (check.cancelled() or check.exception() is not None):
                self._configured.pop(run, None)  # a failed check is made again next time
            raise

    async def _configure(self, run: str) -> None:
        """The run's fingerprint checked (or recorded); then this ledger's launch recorded (or
        read back) and, by the process that recorded it, the earlier launches' orphans failed."""
        await fingerprint.ensure_recorded(self.store, run, self.config, self.resume)
        if self.launch is None:
            return
        launch = await launches.ensure_launched(self.store, self.engine, run, self.launch)
        self._launch_numbers[run] = launch.number
        if launch.recorded and launch.resumed:
            await launches.fail_orphans(self, run, launch)

    async def begin_launch(self, launch: str) -> int:
        """Record from now on as launch `launch` of the job (docs/design.md §14): for an adapter
        that learns the launch after the ledger was opened (TRL's rank-0 token). The ledger's run
        records it (or reads it back, when another process of the launch did) and, if this call
        recorded a resume, fails the earlier launches' open sessions; every session created after
        carries its number. Returns that number in the ledger's run."""
        self._own_loop()
        launch = launches.check_launch(launch)  # type: ignore[assignment]
        if launch is None:
            raise ConfigError("begin_launch needs a launch id, got None")
        if launch != self.launch:
            self.launch = launch
            self._launch_numbers.clear()
            self._configured.clear()  # every run checks its launch again at its next session
        await self._ensure_configured(self.run)
        return self._launch_numbers[self.run]

    @asynccontextmanager
    async def session(
        self, session_id: str, **identity: Unpack[SessionOptions]
    ) -> AsyncIterator[SessionHandle]:
        """A session as a context: normal exit completes it, an exception fails it (and re-raises),
        cancellation or shutdown cancels it (and re-raises)."""
        handle = await self.create_session(session_id, **identity)
        handle._stage = True  # the context ends it: its trajectories and reward ride on that append
        try:
            yield handle
        except Exception as error:
            if not handle.terminal:
                await settle_or_note(handle.fail_with(error), error)
            raise
        except BaseException as error:  # CancelledError, KeyboardInterrupt, SystemExit
            if not handle.terminal:
                await settle_or_note(
                    asyncio.shield(handle.cancel(f"{type(error).__name__}: {error}")), error
                )
            raise
        else:
            if not handle.terminal:
                await handle.complete()

    async def run_session(
        self,
        runner: Runner,
        session_id: str,
        /,
        *,
        timeout: float | None = None,
        recording_timeout: float = RECORDING_TIMEOUT,
        retry: RetryPolicy | None = None,
        **identity: Unpack[RunSessionOptions],
    ) -> SessionOutcome:
        """Run `runner(handle)` as a session under an asyncio timeout.

        A runner's failure or timeout is recorded and reported in the outcome, never raised;
        cancellation is recorded and re-raised. Errors of the ledger itself (bad identifiers,
        database failures) do raise.

        `retry` (default: the ledger's `retry_policy`, one attempt) runs the runner again, on the
        same handle, when an attempt fails with a reason the policy retries: the failed attempt
        is recorded (`AttemptFailed`) and superseded, the next starts after the backoff, and
        only the final attempt decides the outcome and the batch rows. `timeout` is per attempt.

        With a `timeout`, the call returns within its time — `timeout` per attempt (plus the retry
        policy's backoffs), then at most `recording_timeout` seconds (default 10) for recording
        the session's end — however long the database keeps an append waiting (a lock held
        elsewhere, SQLite's busy wait): docs/design.md §12, docs/failures.md. When that time runs
        out first the outcome has state `recording`, reason `timeout` and a `TimeoutError`
        saying so; the recording goes on in the background, and `await outcome.recorded()` gives
        the outcome once the end is in the log (`Ledger.close()` waits for it too; should the
        process die first, `rollout-ledger recover` fails the session as `orphaned`). Without a
        `timeout` the call waits as long as the runner and the database take.
        """
        self._own_loop()
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise InvalidArgumentType(
                f"retry must be a RetryPolicy or None (the ledger's retry_policy), got {retry!r}",
                argument="retry",
            )
        timeout = validation.seconds(timeout, "timeout", forever=True)
        recording_timeout = validation.seconds(recording_timeout, "recording_timeout")
        retry = retry or self.retry_policy
        if timeout is None:
            return await asyncio.ensure_future(
                self._run_session(runner, session_id, None, retry, identity, None)
            )
        budget = timeout * retry.max_attempts + sum(
            retry.backoff(n) for n in range(1, retry.max_attempts)
        )
        deadline = Deadline(asyncio.get_running_loop().time() + budget + recording_timeout)
        work = asyncio.ensure_future(
            self._run_session(runner, session_id, timeout, retry, identity, deadline)
        )
        try:
            done, _ = await asyncio.wait({work}, timeout=budget + recording_timeout)
        except asyncio.CancelledError:
            work.cancel()  # the session records its cancellation (bounded as below), then re-raises
            await asyncio.wait({work}, timeout=recording_timeout)
            raise
        if done:
            return work.result()
        deadline.given_up = True  # the timeout reported is true: no attempt starts after this
        self._recording.add(work)
        work.add_done_callback(self._recording.discard)
        return SessionOutcome(
            session_id,
            "recording",
            vocabulary.TIMEOUT,
            TimeoutError(
                f"session {session_id!r}: run_session's {budget + recording_timeout:g}s ran out (timeout={timeout:g}s "
                f"per attempt, recording_timeout={recording_timeout:g}s) before the session's end was recorded: the "
                "database kept the append waiting (a lock held elsewhere); the recording goes on in the background — "
                "await outcome.recorded() for the recorded outcome"
            ),
            pending=work,
        )

    async def _run_session(
        self,
        runner: Runner,
        session_id: str,
        timeout: float | None,
        retry: RetryPolicy,
        identity: RunSessionOptions,
        deadline: Deadline | None,
    ) -> SessionOutcome:
        handle = await self.create_session(session_id, timeout_s=timeout, **identity)
        handle._stage = True  # run_attempts ends it: trajectories and reward ride on that append
        return await run_attempts(
            handle,
            runner,
            retry=retry,
            metric_policy=self.metric_policy,
            timeout=timeout,
            deadline=deadline,
            blocks=self._loop_blocks,
            budget=partial(self._spent_budget, retry) if retry.budgeted else None,
        )

    async def _spent_budget(self, retry: RetryPolicy, handle: SessionHandle) -> str | None:
        """The retry budget a retry of `handle`'s session would pass, read from the log."""
        view = handle.view
        async with self.engine.connect() as conn:
            group, step = await rm.retries_taken(
                conn, view.run, view.partition, view.global_step, view.uid
            )
        if retry.group_budget is not None and group >= retry.group_budget:
            return GROUP_BUDGET
        if retry.step_budget is not None and step >= retry.step_budget:
            return STEP_BUDGET
        return None

    # ----------------------------------------------------------- projection
    async def project(self) -> int:
        """Project the log to its current end; returns the number of events projected."""
        self._own_loop()
        return await self.projector.run()

    async def batch(
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
        max_staleness=k)` reports the same rows under `ledger/<partition>/all/left_out/stale`.
        """
        bound = staleness.check_bound(max_staleness)
        jagged = validation.flag(jagged, "jagged")
        reward_info = validation.flag(reward_info, "reward_info")
        if logprobs is not None:
            logprobs = validation.flag(logprobs, "logprobs")
            if jagged:
                raise ConfigError(
                    "logprobs= fixes the padded layout's rollout_log_probs column; a jagged batch "
                    "carries the rows' own: drop logprobs, or jagged"
                )
        if jagged and (prompt_width is not None or response_width is not None):
            raise InvalidArgument(
                "prompt_width/response_width fix the padded layout's widths; a jagged batch has "
                "none (densify it with sessions.batches.densify(batch, prompt_width=..., response_width=...))"
            )
        step = await self._settled(partition, global_step, run, timeout, poll_interval)
        split = staleness.split_stale(step.rows, step.global_step, bound)
        if split.left_out:
            logger.warning("batch of %s %s", partition, split.describe(step.global_step))
        infos: dict[str, Any] = {}
        if reward_info:
            async with self.engine.connect() as conn:
                infos = await rm.session_reward_infos(conn, [q["session_id"] for q in split.kept])
        from sessions.batches import (
            build_jagged,
            build_padded,
        )  # torch: imported only when batches are built
        from sessions.batches.rows import materialise

        rows = materialise(split.kept, step.sources)
        if jagged:
            batch = build_jagged(
                rows,
                max_prompt_length=max_prompt_length,
                max_response_length=max_response_length,
                truncate=truncate,
            )
        else:
            batch = build_padded(
                rows,
                pad_token_id=pad_token_id,
                max_prompt_length=max_prompt_length,
                max_response_length=max_response_length,
                prompt_width=prompt_width,
                response_width=response_width,
                truncate=truncate,
                logprobs=logprobs,
            )
        if reward_info:
            from sessions.batches.reward_info import add_reward_info

            add_reward_info(batch, [infos.get(row.meta["session_id"], {}) for row in rows])
        return batch

    async def metrics_dict(
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
        step's failures cost is under `ledger/<partition>/all/cost/` (`sessions.projection.costs`).
        """
        bound = staleness.check_bound(max_staleness)
        step = await self._settled(
            partition, global_step, run, timeout, poll_interval, sources=False
        )
        split = staleness.split_stale(step.rows, step.global_step, bound)
        rows = await self.metrics(partition, global_step, run=step.run, project=False)
        counts = {r.metric: r.value for r in rows if r.data_source is None}
        cost = await costs.step_cost_metrics(
            self.engine, step.run, partition, step.global_step, step.rows, counts, self.min_valid
        )
        return {
            **verl_metrics.metrics_dict(
                partition,
                split.kept,
                rows,
                max_prompt_length=max_prompt_length,
                max_response_length=max_response_length,
            ),
            **split.metrics(partition),
            **cost,
        }

    async def _settled(
        self,
        partition: str,
        global_step: int | None,
        run: str | None,
        timeout: float | None,
        poll_interval: float,
        *,
        sources: bool = True,
    ) -> SettledStep:
        """The step's rows once settled (`sessions.projection.settled`), the caller's partition
        and run checked first; `sources=False` when the events and payloads are not needed."""
        self._own_loop()
        vocabulary.check_partition(partition)
        run = self.run if run is None else vocabulary.check_run(run)
        watch = self._watch(run)
        halted = await _halt(watch)
        try:
            step = await settled_step(
                self.projector,
                self.store,
                run,
                partition,
                global_step,
                timeout=0 if halted is not None else timeout,
                poll_interval=poll_interval,
                sources=sources,
            )
        except StepNotSettled:
            if halted is not None:  # its sessions will not be created: the halt is the answer
                raise halted from None
            raise
        halted = halted or await _halt(watch)
        if halted is not None and any(
            row.get("source_position", 0) >= halted.tripped_at for row in step.rows
        ):
            raise halted  # the step saw the failures that halted the run: not one to train on
        return step

    def _watch(self, run: str) -> RunWatch:
        watch = self._watches.get(run)
        if watch is None:
            watch = self._watches[run] = RunWatch(self.store, self.engine, run)
        return watch

    async def metrics(
        self,
        partition: str | None = None,
        global_step: int | None | EllipsisType = ...,
        *,
        run: str | None = None,
        project: bool = True,
    ) -> list[MetricRow]:
        """Metric counts of a run (default: this ledger's), optionally one partition and step.

        `global_step`: `...` (default) every step; an integer that step; None only the rows of
        sessions recorded without a step.
        """
        self._own_loop()
        if partition is not None:
            vocabulary.check_partition(partition)
        run = self.run if run is None else vocabulary.check_run(run)
        if global_step is not ...:
            global_step = validation.read_step(global_step)
        if validation.flag(project, "project"):
            await self.project()
        async with self.engine.connect() as conn:
            rows = await rm.metric_rows(conn, run=run, partition=partition, global_step=global_step)
        return [MetricRow.from_row(row) for row in rows]


__all__ = ["DEFAULT_RUN", "RECORDING_TIMEOUT", "Ledger", "Runner"]
