"""`LedgerRollout`: TRL's `rollout_func`, each completion a ledger session.

`GRPOTrainer._generate` calls `rollout_func(prompts, trainer)` with no try around it, and the
synchronous trainer has no timeout for it: one raising or hanging rollout ends or hangs the step.
The wrapper runs the user's runner once per completion under `SyncLedger.arun_session` (the
per-session timeout, the run's `RetryPolicy`), and returns TRL a row for every session: the
runner's completion, or a placeholder (`completion.py`) for a failed one. Group identity comes
from TRL's own layout (`identity.py`), partition from the trainer's mode (`train`, else `val`),
the step from `trainer.state.global_step`. A runner may record each turn's generation as a
model call through `context.calls` (`turns.py`) and leave its row to them: the row TRL gets is
then the one the ledger assembles from the calls. `docs/trl.md` shows the whole setup.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sessions import RetryPolicy, SessionOutcome, SyncLedger
from sessions.calls import AssembledRow, assemble
from sessions.integrations.trl.completion import (
    Completion,
    builds_from_calls,
    parse_completion,
    trl_output,
)
from sessions.integrations.trl.errors import TRLSetupError
from sessions.integrations.trl.identity import Slot, launch_token, slots
from sessions.integrations.trl.loss_types import ROW_MEAN_LOSS_TYPES
from sessions.integrations.trl.reward import LedgerReward, eval_figures_callback, ledger_figures
from sessions.integrations.trl.runner_loop import RunnerLoop, in_thread
from sessions.integrations.trl.turns import ModelCalls

__all__ = ["Generation", "LedgerRollout", "RolloutContext"]


@dataclass(frozen=True)
class RolloutContext:
    """What a runner is told besides its prompt: the trainer (its model, tokenizer, state) and
    which session it is running."""

    trainer: Any
    session_id: str
    uid: str
    session_index: int
    partition: str
    global_step: int
    #: the completion's row in the generation call over all ranks, in rank order (on one
    #: process, its index in `prompts`); TRL's group g is rows g*n to g*n + n - 1
    row: int
    #: which `rollout_func` call this is (0, 1, ... in this launch, the same on every rank)
    call: int
    #: records the runner's model calls, turn by turn, in its session (`turns.py`; docs/trl.md
    #: "Per-turn model calls"); None outside a `LedgerRollout` session
    calls: ModelCalls | None = None


@dataclass
class Generation:
    """One `rollout_func` call as the ledger recorded it."""

    partition: str
    global_step: int
    call: int
    outcomes: list[SessionOutcome] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(not o.succeeded for o in self.outcomes)


Runner = Callable[[Any, RolloutContext], Any]


class LedgerRollout:
    """Pass as `GRPOTrainer(rollout_func=rollout, reward_funcs=rollout.reward, ...)`.

    `runner(prompt, context)` (a function or an async function) runs one completion and returns a
    dict with `prompt_ids`, `completion_ids`, `reward` and optionally `logprobs`, `env_mask`,
    `num_turns` and extra columns for TRL's reward functions; a runner that recorded its turns
    through `context.calls` may return only `reward` (and extra columns), and its row is the one
    its calls make (docs/trl.md, "Per-turn model calls"). `timeout` is seconds per attempt;
    `retry` defaults to the ledger's `retry_policy`. `concurrency` bounds the sessions running at
    once (default: all of a call for an async runner, one for a synchronous one, which often
    drives the trainer's own model). `metrics_timeout` bounds the wait for a step to settle before
    its figures are logged; `placeholder_token_id` defaults to the tokenizer's pad token.
    """

    def __init__(
        self,
        runner: Runner,
        ledger: SyncLedger,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        concurrency: int | None = None,
        data_source: str | None = None,
        metrics_timeout: float = 60.0,
        placeholder_token_id: int | None = None,
    ) -> None:
        _check_runner(runner)
        _check_ledger(ledger)
        if concurrency is not None and (
            isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
        ):
            raise TRLSetupError(f"concurrency must be an integer >= 1 or None, got {concurrency!r}")
        self.runner = runner
        self.ledger = ledger
        self.timeout = timeout
        self.retry = retry
        self.is_async = _is_async(runner)
        self.concurrency = (
            concurrency if concurrency is not None else (None if self.is_async else 1)
        )
        self.data_source = data_source
        self.metrics_timeout = metrics_timeout
        self.placeholder_token_id = placeholder_token_id
        #: the companion reward function: the rows' rewards, and the ledger's figures in TRL's log
        self.reward = LedgerReward(self)
        #: the latest call (the one TRL is scoring now); older ones are dropped with their errors
        self.last: Generation | None = None
        #: calls made so far, and the val steps they recorded (an evaluation's figures wait for them)
        self.calls = 0
        self.val_steps: set[int] = set()
        self._token: str | None = None
        self._trainer: Any = None
        self._loop: RunnerLoop | None = None

    # --------------------------------------------------------------------- TRL's entry point
    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, Any]:
        self._setup(trainer)
        assert self._loop is not None and self._token is not None
        partition = "train" if trainer.model.training else "val"
        step = int(trainer.state.global_step)
        size = trainer.num_generations if partition == "train" else trainer.num_generations_eval
        generation = Generation(partition, step, self.calls)
        self.calls += 1
        layout = slots(
            prompts,
            process_index=trainer.accelerator.process_index,
            group_size=size,
            token=self._token,
            call=generation.call,
        )
        completions, generation.outcomes = self._loop.run(
            self._run_all(prompts, layout, trainer, generation, size)
        )
        self.last = generation
        if partition == "val":
            self.val_steps.add(step)
        failures = [
            None if o.succeeded else (o.failure_reason or o.state) for o in generation.outcomes
        ]
        rows = [
            c if o.succeeded else None
            for c, o in zip(completions, generation.outcomes, strict=True)
        ]
        return trl_output(
            rows, failures, [s.session_id for s in layout], self._placeholder_token(trainer)
        )

    def figures(self, partition: str, global_step: int) -> dict[str, float]:
        """The ledger's own figures of a settled step, by their `metrics_dict` names."""
        return ledger_figures(self.ledger, partition, global_step, timeout=self.metrics_timeout)

    def close(self) -> None:
        """Stop the runners' loop (the ledger is the caller's to close)."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # ------------------------------------------------------------------------- internals
    def _setup(self, trainer: Any) -> None:
        """Check the trainer once (``check_trainer``), then take the launch's token, start the
        runners' loop and register the evaluation callback."""
        if trainer is self._trainer:
            return
        self.check_trainer(trainer)
        self._token = launch_token(trainer)
        if self.ledger.ledger.launch is None:
            # A resumed trainer (`resume_from_checkpoint`) is a new launch, the same on every rank:
            # the dead launch's open sessions fail at once and a re-run step counts this one's only
            # (docs/design.md §14). A launch the user named (option, environment) is kept.
            self.ledger.begin_launch(f"trl-{self._token}")
        if self._loop is None:
            self._loop = RunnerLoop()
        trainer.add_callback(eval_figures_callback(self, trainer))
        self._trainer = trainer

    def check_trainer(self, trainer: Any) -> None:
        """Refuse, with the setting to change, a trainer under which the ledger's rows or figures
        would be wrong. ``LedgerGRPOTrainer`` calls it when it is built, so a wrong setup is one
        error before any rollout; with TRL's own ``GRPOTrainer`` it runs at the first rollout."""
        _check_ledger(self.ledger)
        if not any(f is self.reward for f in getattr(trainer, "reward_funcs", ())):
            raise TRLSetupError(
                "the trainer's reward_funcs lack this rollout's companion: pass "
                "GRPOTrainer(reward_funcs=rollout.reward, rollout_func=rollout, ...) (add your other reward "
                "functions beside it), so failed rows get a None reward and the ledger's figures are logged"
            )
        if getattr(trainer, "tools", None):
            raise TRLSetupError(
                "GRPOTrainer was given tools: TRL then runs its own tool loop on rollout_func's rows and ignores "
                "their env_mask, so a failed session's placeholder would not be masked; run the tools inside "
                "the runner instead"
            )
        args = trainer.args
        if args.steps_per_generation * trainer.num_iterations < args.gradient_accumulation_steps:
            raise TRLSetupError(
                f"steps_per_generation ({args.steps_per_generation}) x num_iterations ({trainer.num_iterations}) "
                f"< gradient_accumulation_steps ({args.gradient_accumulation_steps}): TRL would generate several "
                "times per optimizer step, and the ledger records one train step per generation; set "
                "steps_per_generation >= gradient_accumulation_steps (TRL's default makes them equal)"
            )
        loss_type = getattr(trainer, "loss_type", None)
        if loss_type in ROW_MEAN_LOSS_TYPES and not getattr(
            trainer, "averages_trainable_rows", False
        ):
            warnings.warn(
                f"loss_type={loss_type!r} divides by every row of a micro-batch, placeholders included, so "
                "failed sessions shrink each step's loss and gradient; train with "
                "sessions.integrations.trl.LedgerGRPOTrainer, or loss_type='dapo' (docs/trl.md)",
                UserWarning,
                stacklevel=3,
            )

    def _placeholder_token(self, trainer: Any) -> int:
        if self.placeholder_token_id is not None:
            return self.placeholder_token_id
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        token = getattr(tokenizer, "pad_token_id", None)
        if token is None:
            raise TRLSetupError(
                "the tokenizer has no pad_token_id; pass LedgerRollout(placeholder_token_id=...)"
            )
        return int(token)

    async def _run_all(
        self,
        prompts: Sequence[Any],
        layout: list[Slot],
        trainer: Any,
        generation: Generation,
        size: int,
    ) -> tuple[list[Completion | None], list[SessionOutcome]]:
        completions: list[Completion | None] = [None] * len(prompts)
        gate = asyncio.Semaphore(self.concurrency or len(prompts) or 1)

        async def one(i: int) -> SessionOutcome:
            slot = layout[i]
            context = RolloutContext(
                trainer,
                slot.session_id,
                slot.uid,
                slot.session_index,
                generation.partition,
                generation.global_step,
                slot.row,
                generation.call,
            )

            async def runner(session: Any) -> None:
                recorder = ModelCalls(session, asyncio.get_running_loop(), generation.global_step)
                result = await self._invoke(prompts[i], replace(context, calls=recorder))
                assembled = _assembled(session, result)
                if assembled == []:  # calls started, none answered: `complete` fails it closed
                    return
                completion = parse_completion(result, assembled)
                if not completion.call_ids:  # else the ledger assembles this row at complete
                    await session.record_trajectory(
                        prompt_ids=completion.prompt_ids,
                        response_ids=completion.completion_ids,
                        response_mask=completion.env_mask,
                        response_logprobs=completion.logprobs,
                        num_turns=completion.num_turns,
                    )
                await session.post_reward(completion.reward)
                completions[i] = completion  # the final attempt's, set only once it is recorded

            async with gate:  # a session is created when a slot frees, so waiting costs no timeout
                return await self.ledger.arun_session(
                    runner,
                    slot.session_id,
                    uid=slot.uid,
                    session_index=slot.session_index,
                    group_size=size,
                    partition=generation.partition,
                    global_step=generation.global_step,
                    data_source=self.data_source,
                    metadata={
                        "trl": {"prompt_key": slot.key, "rank": trainer.accelerator.process_index}
                    },
                    timeout=self.timeout,
                    retry=self.retry,
                )

        results = await asyncio.gather(
            *(one(i) for i in range(len(prompts))), return_exceptions=True
        )
        for result in results:
            if isinstance(
                result, BaseException
            ):  # the ledger's own error (the database), not a rollout's
                raise result
        return completions, list(results)  # type: ignore[arg-type]

    async def _invoke(self, prompt: Any, context: RolloutContext) -> Any:
        if self.is_async:
            result = self.runner(prompt, context)
        else:
            result = await in_thread(lambda: self.runner(prompt, context), context.session_id)
        if inspect.isawaitable(result):
            result = await result
        return result


def _assembled(session: Any, result: Any) -> list[AssembledRow] | None:
    """The rows the attempt's recorded calls make, when the runner's result leaves its row to
    them (none when it started calls and none was answered); None when it started no call (or
    returned its row itself)."""
    if not builds_from_calls(result) or not session.view.calls:
        return None
    return assemble(session.view.recorded_calls())


def _check_runner(runner: Any) -> None:
    """A runner that cannot take ``(prompt, context)`` refused when the wrapper is built, not as
    a failed session per row."""
    if not callable(runner):
        raise TRLSetupError(
            f"runner must be callable (prompt, context) -> dict, got {runner!r:.80}"
        )
    try:
        signature = inspect.signature(runner)
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to check here
        return
    try:
        signature.bind(None, None)
    except TypeError as error:
        raise TRLSetupError(
            f"runner {getattr(runner, '__qualname__', runner)!r:.80} cannot be called as "
            f"runner(prompt, context) ({error}); its signature is {signature}"
        ) from None


def _check_ledger(ledger: Any) -> None:
    """The wrapper records through an open ``SyncLedger`` (its sessions run on the wrapper's own
    loop, TRL's trainer is synchronous)."""
    if not isinstance(ledger, SyncLedger):
        raise TRLSetupError(
            f"LedgerRollout needs a SyncLedger, got {type(ledger).__name__}: open it with "
            "sessions.SyncLedger.open(URL, run=...) (an async Ledger serves its own event loop only)"
        )
    if ledger.closed:
        raise TRLSetupError(
            "the SyncLedger given to LedgerRollout is closed; open it before the trainer and close "
            "it after train() (with SyncLedger.open(...) as ledger: ...)"
        )


def _is_async(runner: Callable[..., Any]) -> bool:
    """An async function, a partial of one, or an object whose `__call__` is one."""
    while hasattr(runner, "func"):  # functools.partial
        runner = runner.func  # type: ignore[attr-defined]
    return inspect.iscoroutinefunction(runner) or inspect.iscoroutinefunction(type(runner).__call__)
