"""Per-turn model calls through TRL's `rollout_func` (docs/trl.md, "Per-turn model calls").

A multi-turn runner records each turn's generation through `context.calls` against a stand-in
server and returns only its reward: the row TRL trains on is assembled from the calls, and equals
the ledger's own row of the session token for token (what TRL buffered for its loss, read back
from the trainer). A runner that crashes after call k of n leaves k calls and a failed session
(a placeholder in TRL's batch); a failed call stays in the log as failed while the retried turn
makes the row. Run with TRL 1.16's real `GRPOTrainer` on both backends; the pieces that need no
TRL (TRL's log-prob shape, the refusals) run without it.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessions import SandboxError, SyncLedger
from sessions.calls import AssembledRow
from sessions.cli.sql import run_query
from sessions.integrations.trl import LedgerRollout, RolloutContext, RunnerOutputError
from sessions.integrations.trl.completion import parse_completion
from sessions.integrations.trl.turns import STEP_VERSION, sampled_logprobs
from store import create_engine
from tests import REPO
from tests.conftest import BACKENDS
from tests.integrations.trl.test_trl import ROWS, load_example, require_trl, reward_of, trainer_for

TURNS = 3
#: (generation call, row) -> the number of calls recorded before the runner crashes
CRASHES = {(0, 5): 2, (0, 9): 1, (0, 30): 2}
#: (generation call, row, turn) whose first call the stand-in server fails (the turn is retried)
SERVER_ERRORS = {(0, 2, 1), (0, 17, 0)}
#: (generation call, row) whose async runner returns with its first call started and unanswered
UNANSWERED = {(0, 12)}


# ================================================================= without TRL: the pieces
def test_trls_logprobs_become_one_per_token() -> None:
    # TRL's default (logprobs=0): one entry per token, the sampled one
    assert sampled_logprobs([[-0.5], [-1.0]]) == [-0.5, -1.0]
    # top-k: the sampled token's entry, wherever its probability put it
    top = [[-0.1, -2.0], [-0.3, -0.9]]
    assert sampled_logprobs(top, [[7, 8], [4, 9]], [8, 4]) == [-2.0, -0.3]
    assert sampled_logprobs([-0.25, -0.5]) == [-0.25, -0.5]
    with pytest.raises(RunnerOutputError, match="not among its logprob_token_ids"):
        sampled_logprobs(top, [[7, 8], [4, 9]], [8, 5])


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 500), min_size=1, max_size=6, unique=True),
            st.data(),
        ),
        max_size=12,
    )
)
def test_the_sampled_tokens_logprob_is_picked_wherever_it_ranks(tokens: list[Any]) -> None:
    """TRL's top-k `[token][k]` lists: the entry of the sampled token, at any rank."""
    logprobs, ids, completion, expected = [], [], [], []
    for candidates, data in tokens:
        sampled = data.draw(st.sampled_from(candidates))
        values = [-0.5 * (rank + 1) for rank in range(len(candidates))]
        logprobs.append(values)
        ids.append(candidates)
        completion.append(sampled)
        expected.append(values[candidates.index(sampled)])
    assert sampled_logprobs(logprobs, ids, completion) == expected


def _row(call_ids: list[str], logprobs: bool = True) -> AssembledRow:
    response = np.array([7, 8, 20, 21, 9], dtype=np.int32)
    return AssembledRow(
        call_ids=call_ids,
        prompt_ids=np.array([3, 4, 5], dtype=np.int32),
        response_ids=response,
        response_mask=np.array([1, 1, 0, 0, 1], dtype=np.uint8),
        logprobs=np.array([-0.5, -1.0, 0.0, 0.0, -0.25], dtype=np.float32) if logprobs else None,
        min_version=0,
        max_version=0,
        num_turns=4,
    )


def test_a_result_without_its_row_takes_the_row_its_calls_make() -> None:
    done = parse_completion({"reward": 0.5, "answer": "w7"}, [_row(["c1", "c2"])])
    assert (done.prompt_ids, done.completion_ids, done.env_mask) == (
        [3, 4, 5],
        [7, 8, 20, 21, 9],
        [1, 1, 0, 0, 1],
    )
    assert done.logprobs == [-0.5, -1.0, 0.0, 0.0, -0.25] and done.num_turns == 4
    assert done.call_ids == ("c1", "c2") and done.extra == {"answer": "w7"}
    # a row handed over whole is the row, whatever calls the runner recorded (design §15)
    whole = parse_completion(
        {"prompt_ids": [1], "completion_ids": [2], "reward": 1.0}, [_row(["c1"])]
    )
    assert whole.completion_ids == [2] and whole.call_ids == ()


@pytest.mark.parametrize(
    ("result", "rows", "problem"),
    [
        ({"reward": 1.0}, None, "record each turn through context.calls"),
        ({"reward": 1.0, "env_mask": [1]}, [_row(["c1"])], "assembled from its recorded"),
        ({"answer": 1}, [_row(["c1"])], "lacks reward"),
        ({"reward": 1.0}, [_row(["c1"]), _row(["c2"])], "make 2 rows.*c2 do not extend"),
    ],
)
def test_a_result_its_calls_cannot_complete_fails_as_invalid_output(
    result: dict[str, Any], rows: list[AssembledRow] | None, problem: str
) -> None:
    with pytest.raises(RunnerOutputError, match=problem) as caught:
        parse_completion(result, rows)
    assert caught.value.reason == "invalid_output"


# ================================================================== with TRL: real training
@pytest.fixture(scope="module")
def example() -> Any:
    require_trl()
    return load_example()


class StandInServer:
    """What a vLLM server would answer for one turn, in TRL's shape (`VLLMClient.generate`:
    `completion_ids`, `logprobs` as `[token][k]`, `logprob_token_ids`), from (call, row, turn)."""

    def __init__(self) -> None:
        self.refused: Counter[tuple[int, int, int]] = Counter()

    def answer(self, context: RolloutContext, turn: int) -> Any:
        def generate(prompt_ids: list[int]) -> dict[str, Any]:
            key = (context.call, context.row, turn)
            if key in SERVER_ERRORS and not self.refused[key]:
                self.refused[key] += 1
                raise ConnectionResetError("the server dropped the connection")
            first = 3 + (7 * context.row + 11 * turn + len(prompt_ids)) % 60
            completion = [first, 3 + (first + 5) % 60]
            return {
                "completion_ids": completion,
                "logprobs": [[-0.125 * (turn + 1)], [-0.25 * (turn + 1)]],
                "logprob_token_ids": [[t] for t in completion],
                "finish_reason": "tool_calls" if turn < TURNS - 1 else "stop",
            }

        return generate


def tool_output(row: int, turn: int) -> list[int]:
    """What the tool answered after turn `turn`: environment tokens (mask 0)."""
    return [3 + (row + 40 + turn) % 60, 3 + (row + 50 + turn) % 60]


class ToolAgent:
    """TURNS model calls per session, each through `context.calls`; the row is left to them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.server = StandInServer()

    async def runner(self, prompt: str, context: RolloutContext) -> dict[str, Any]:
        assert context.calls is not None
        ids = list(self.tokenizer(prompt)["input_ids"])
        for turn in range(TURNS):
            if CRASHES.get((context.call, context.row)) == turn:
                raise SandboxError(f"the sandbox was lost after call {turn} of {TURNS}")
            if (context.call, context.row) in UNANSWERED:  # a bug: the answer is never recorded
                await context.calls.astart(turn=turn)
                return {"reward": 1.0}
            try:
                answer = await context.calls.agenerate(
                    self.server.answer(context, turn), ids, turn=turn, sampling={"temperature": 1.0}
                )
            except ConnectionResetError:  # the client retries the turn once
                answer = await context.calls.agenerate(
                    self.server.answer(context, turn), ids, turn=turn
                )
            ids += answer["completion_ids"]
            if turn < TURNS - 1:
                ids += tool_output(context.row, turn)
        return {"reward": reward_of(context.call, context.row)}

    def sync_runner(self, prompt: str, context: RolloutContext) -> dict[str, Any]:
        """The same agent written synchronously, with the blocking forms."""
        assert context.calls is not None
        ids = list(self.tokenizer(prompt)["input_ids"])
        for turn in range(TURNS):
            if CRASHES.get((context.call, context.row)) == turn:
                raise SandboxError(f"the sandbox was lost after call {turn} of {TURNS}")
            call_id = context.calls.start(turn=turn)
            try:
                answer = self.server.answer(context, turn)(ids)
            except ConnectionResetError as error:
                context.calls.fail(call_id, error)
                call_id = context.calls.start(turn=turn)
                answer = self.server.answer(context, turn)(ids)
            context.calls.record(
                call_id,
                prompt_ids=ids,
                completion_ids=answer["completion_ids"],
                logprobs=sampled_logprobs(answer["logprobs"]),
                finish_reason=answer["finish_reason"],
            )
            ids += answer["completion_ids"]
            if turn < TURNS - 1:
                ids += tool_output(context.row, turn)
        return {"reward": reward_of(context.call, context.row)}


def model_calls(url: str) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        engine = create_engine(url)
        try:
            columns, rows = await run_query(
                engine,
                "SELECT session_id, attempt, call_id, turn, outcome, prompt_tokens, response_tokens, "
                "min_version, max_version, finish_reason, error_type FROM model_calls "
                "ORDER BY started_position",
            )
        finally:
            await engine.dispose()
        return [dict(zip(columns, row)) for row in rows]

    return asyncio.run(read())


def trained_rows(inputs: dict[str, Any]) -> list[tuple[tuple[Any, ...], ...]]:
    """The rows of TRL's buffered micro-batch that have a loss token, unpadded, as a multiset:
    prompt, completion, tool mask (1 = the model's token), sampling log-probs."""
    out = []
    for i in range(inputs["prompt_ids"].shape[0]):
        length = int(inputs["completion_mask"][i].sum())
        tool = inputs["tool_mask"][i][:length]
        if int((inputs["completion_mask"][i][:length] * tool).sum()) == 0:
            continue  # a placeholder
        prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()]
        out.append(
            (
                tuple(prompt.tolist()),
                tuple(inputs["completion_ids"][i][:length].tolist()),
                tuple(tool.tolist()),
                tuple(inputs["sampling_per_token_logps"][i][:length].tolist()),
            )
        )
    return sorted(out)


def ledger_rows(batch: Any) -> list[tuple[tuple[Any, ...], ...]]:
    """The same of the ledger's batch: its rows that are not placeholders."""
    out = []
    for i in range(batch["prompts"].shape[0]):
        if bool(batch["is_placeholder"][i]):
            continue
        p, r = int(batch["prompt_length"][i]), int(batch["response_length"][i])
        out.append(
            (
                tuple(batch["prompts"][i][batch["prompts"].shape[1] - p :].tolist()),
                tuple(batch["responses"][i][:r].tolist()),
                tuple(batch["response_mask"][i][:r].tolist()),
                tuple(batch["rollout_log_probs"][i][:r].tolist()),
            )
        )
    return sorted(out)


def check_the_run(
    url: str, ledger: SyncLedger, trainer: Any, output: dict[str, Any], unanswered: Any = ()
) -> None:
    """What a run of ToolAgent over one step must have left, in the log, the batch and TRL
    (`unanswered`: the (call, row) whose runner left its first call open)."""
    calls = model_calls(url)
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for call in calls:
        by_session[call["session_id"]].append(call)
    sessions = dict(zip(output["ledger_session_id"], output["ledger_failure"], strict=True))
    assert len(sessions) == ROWS and set(by_session) == set(sessions)
    crashed = {output["ledger_session_id"][row]: k for (_, row), k in CRASHES.items()}
    left_open = {output["ledger_session_id"][row] for _, row in unanswered}
    for session_id, failure in sessions.items():
        made = by_session[session_id]
        recorded = [c for c in made if c["outcome"] == "recorded"]
        if session_id in left_open:  # failed closed: never a row without its call
            assert failure == "incomplete_capture" and [c["outcome"] for c in made] == ["open"]
            continue
        assert all(c["outcome"] in ("recorded", "failed") for c in made)  # none left open
        if session_id in crashed:  # a crash after call k of n: k calls, and a failed session
            assert failure == "sandbox_error" and len(recorded) == crashed[session_id]
        else:
            assert failure is None and [c["turn"] for c in recorded] == list(range(TURNS))
        # TRL reports no version: each call carries the step whose weights TRL synced
        assert all((c["min_version"], c["max_version"]) == (0, 0) for c in recorded)
        assert all(b["prompt_tokens"] > a["prompt_tokens"] for a, b in zip(recorded, recorded[1:]))
    failed = [c for c in calls if c["outcome"] == "failed"]
    assert len(failed) == len(SERVER_ERRORS) and {c["error_type"] for c in failed} == {
        "ConnectionResetError"
    }
    # the row TRL trains on is the ledger's own row of the session, token for token
    batch = ledger.batch("train", 0)
    failures = len(CRASHES) + len(unanswered)
    assert int(batch["is_placeholder"].sum()) == failures
    (inputs,) = trainer._buffered_inputs
    ours = ledger_rows(batch)
    assert len(ours) == ROWS - failures and trained_rows(inputs) == ours
    assert all(mask.count(0) == 2 * (TURNS - 1) for _, _, mask, _ in ours)  # the tool's tokens
    # and session by session: the row rollout_func handed TRL is the session's batch row
    for i, session_id in enumerate(list(batch["session_id"])):
        if bool(batch["is_placeholder"][i]):
            continue
        p, r = int(batch["prompt_length"][i]), int(batch["response_length"][i])
        row = output["ledger_session_id"].index(session_id)
        assert (
            output["prompt_ids"][row]
            == batch["prompts"][i][batch["prompts"].shape[1] - p :].tolist()
        )
        assert output["completion_ids"][row] == batch["responses"][i][:r].tolist()
        assert output["env_mask"][row] == batch["response_mask"][i][:r].tolist()
        assert int(batch["num_turns"][i]) == 2 * TURNS  # verl's count: 2 tool + 3 model + 1
        assert (list(batch["min_global_steps"])[i], list(batch["max_global_steps"])[i]) == (0, 0)


def capture(rollout: LedgerRollout) -> tuple[Any, dict[str, Any]]:
    """`rollout` as TRL's rollout_func, keeping the last dict it returned to TRL."""
    seen: dict[str, Any] = {}

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        seen.clear()
        seen.update(rollout(prompts, trainer))
        return dict(seen)

    return rollout_func, seen


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_per_turn_calls_make_the_row_trl_trains_on(
    example: Any, db_url: str, tmp_path: Path
) -> None:
    agent = ToolAgent(example.tiny_tokenizer())
    with SyncLedger.open(db_url, run="trl-calls") as ledger:
        rollout = LedgerRollout(agent.runner, ledger, timeout=30)
        func, output = capture(rollout)
        trainer = trainer_for(example, rollout, tmp_path, steps=1, max_completion_length=32)
        trainer.rollout_func = func
        try:
            trainer.train()
        finally:
            rollout.close()
        check_the_run(db_url, ledger, trainer, output, UNANSWERED)
        # every session that succeeded was assembled from its calls, never handed over whole
        figures = ledger.metrics_dict("train", 0)
        rows_with_versions = figures["ledger/train/all/off_policy/rows_with_versions"]
        assert rows_with_versions == ROWS - len(CRASHES) - len(UNANSWERED)


def test_a_synchronous_runner_records_its_turns_with_the_blocking_forms(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    agent = ToolAgent(example.tiny_tokenizer())
    with SyncLedger.open(sqlite_url, run="trl-calls-sync") as ledger:
        rollout = LedgerRollout(agent.sync_runner, ledger, timeout=30, concurrency=4)
        func, output = capture(rollout)
        trainer = trainer_for(example, rollout, tmp_path, steps=1, max_completion_length=32)
        trainer.rollout_func = func
        try:
            trainer.train()
        finally:
            rollout.close()
        check_the_run(sqlite_url, ledger, trainer, output)


def test_a_blocking_form_on_an_event_loop_is_refused_with_the_awaitable_one() -> None:
    from sessions.integrations.trl import TRLSetupError
    from sessions.integrations.trl.turns import ModelCalls

    async def blocked() -> None:
        calls = ModelCalls(object(), asyncio.get_running_loop(), step=0)
        calls.start(turn=0)

    with pytest.raises(TRLSetupError, match="awaits context.calls.astart"):
        asyncio.run(blocked())
    assert repr(STEP_VERSION) == "STEP_VERSION"


def test_the_docs_per_turn_block_runs_as_printed(
    example: Any, sqlite_url: str, tmp_path: Path
) -> None:
    """docs/trl.md's per-turn runner, with the user's generation, tool and score stand-ins."""
    text = (REPO / "docs" / "trl.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- per-turn:[^\n]*-->\n```python\n(.*?)```", text, re.S)
    assert block is not None
    namespace: dict[str, Any] = {
        "tokenizer": example.tiny_tokenizer(),
        "my_generate": lambda ids: {"completion_ids": [3 + len(ids) % 60, 4 + len(ids) % 59]},
        "run_tool": lambda completion: [5, 6, 7],
        "my_score": lambda ids: len(ids) % 3 / 2,
    }
    exec(compile(block.group(1), "docs/trl.md", "exec"), namespace)  # noqa: S102 - the doc's code
    with SyncLedger.open(sqlite_url, run="trl-docs") as ledger:
        rollout = LedgerRollout(namespace["my_agent"], ledger)
        trainer = trainer_for(example, rollout, tmp_path, steps=1, max_completion_length=32)
        try:
            trainer.train()
        finally:
            rollout.close()
        batch = ledger.batch("train", 0)
    calls = model_calls(sqlite_url)
    assert len(calls) == 3 * ROWS and {c["outcome"] for c in calls} == {"recorded"}
    assert not bool(batch["is_placeholder"].any())
    masks = [batch["response_mask"][i][: int(batch["response_length"][i])] for i in range(ROWS)]
    assert all(mask.tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1] for mask in masks)
