"""verl's agent loops recorded call by call (docs/design.md §15, docs/verl.md "Model calls").

verl 0.9.1's own ``single_turn_agent`` and ``tool_agent`` loops run inside the ledger agent loop
against the stand-in LLM server (``llm_server.py``). Each ``generate`` is a model call in the log
as it happens; the session's row is assembled from the calls and equals verl's
``AgentLoopOutput`` (so the ledger's batch equals verl's, row for row); a run whose server dies
on its third call leaves its two recorded calls and a failed session; the versions verl's server
client stamps reach the batch, and verl V1's staleness lines on the ledger's rows give the
ledger's figures.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from sessions.batches import non_tensor
from tests.integrations.verl import llm_server as llm
from tests.integrations.verl import test_agent_loop as agent_loop_tests
from tests.integrations.verl.test_agent_loop import (
    PROMPTS,
    N,
    assert_same_rows,
    config,
    generate,
    ledger_view,
    placeholders,
)
from tests.projection.test_off_policy import _verl_block

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

# the agent-loop module's fixtures, shared: its tiny-policy folder and its fresh worker state
model = agent_loop_tests.model
fresh_process_state = agent_loop_tests.fresh_process_state

TOOL_AGENT = "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"
#: four model calls (three tool calls and an answer) need more than the other tests' 64 tokens
LONG = 192
FOUR_TURNS = (
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
    f"actor_rollout_ref.rollout.response_length={LONG}",
)


async def _calls(url: str, step: int) -> dict[str, list[dict[str, Any]]]:
    """The `model_calls` view's rows of a step, by session, in call order."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            rows = (
                await connection.execute(
                    text(
                        "SELECT m.session_id, m.call_id, m.outcome, m.prompt_tokens, "
                        "m.response_tokens, m.min_version, m.max_version, m.error_type "
                        "FROM model_calls m JOIN sessions s ON s.session_id = m.session_id "
                        "WHERE s.global_step = :step ORDER BY m.session_id, m.started_position"
                    ),
                    {"step": step},
                )
            ).mappings()
            out: dict[str, list[dict[str, Any]]] = {}
            for row in rows:
                out.setdefault(row["session_id"], []).append(dict(row))
            return out
    finally:
        await engine.dispose()


async def _sessions(url: str, step: int) -> dict[str, dict[str, Any]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(
                text(
                    "SELECT session_id, state, failure_reason, model_calls, model_calls_failed "
                    "FROM sessions WHERE global_step = :step"
                ),
                {"step": step},
            )
            return {row.session_id: dict(row._mapping) for row in rows}
    finally:
        await engine.dispose()


async def _rows_from_calls(url: str, step: int) -> int:
    """How many of the step's trajectories were assembled from recorded calls."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            return int(
                (
                    await connection.execute(
                        text(
                            "SELECT count(*) FROM events e JOIN sessions s "
                            "ON s.session_id = e.session_id WHERE s.global_step = :step "
                            "AND e.type = 'TrajectoryRecorded' AND e.data LIKE :calls"
                        ),
                        {"step": step, "calls": '%"from_calls":["c%'},
                    )
                ).scalar_one()
            )
    finally:
        await engine.dispose()


async def test_single_turn_runs_are_one_recorded_call_each_and_rows_made_from_them(
    model: Path, sqlite_url: str
) -> None:
    cfg = config(model, sqlite_url)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    _, out = await generate(cfg, model, {5: "crash"}, step=2)
    batch, _ = await ledger_view(sqlite_url, "train", 2, pad)
    assert placeholders(out) == [5]
    calls = await _calls(sqlite_url, 2)
    sessions = await _sessions(sqlite_url, 2)
    assert len(sessions) == 16
    for sid, session in sessions.items():
        outcomes = [c["outcome"] for c in calls.get(sid, [])]
        if session["state"] == "succeeded":
            assert outcomes == ["recorded"], sid
        else:  # the server raised: the call is recorded as failed, the session failed with it
            assert outcomes == ["failed"] and session["model_calls_failed"] == 1, sid
    assert await _rows_from_calls(sqlite_url, 2) == 15
    assert_same_rows(out, batch)


async def test_tool_agent_rows_assembled_from_calls_equal_verls_outputs(
    model: Path, sqlite_url: str
) -> None:
    """Rows 0-3 hold four-call conversations (three tool calls, then an answer), rows 4-5 two;
    every row the ledger assembles from its calls is verl's `AgentLoopOutput`, token for token."""
    cfg = config(model, sqlite_url, TOOL_AGENT, *FOUR_TURNS)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    faults = {**{i: "tools3" for i in range(4)}, 4: "tool", 5: "tool"}
    _, out = await generate(cfg, model, faults, step=6)
    batch, _ = await ledger_view(sqlite_url, "train", 6, pad, response_width=LONG)
    assert placeholders(out) == []
    calls = await _calls(sqlite_url, 6)
    per_session = sorted(len(c) for c in calls.values())
    assert Counter(per_session)[4] == 4 and Counter(per_session)[2] == 2, per_session
    # every conversation's row is made from its calls (verl's row and the assembled one agree)
    assert await _rows_from_calls(sqlite_url, 6) == 16
    assert_same_rows(out, batch)
    turns = out.non_tensor_batch["__num_turns__"]
    assert [int(turns[i]) for i in range(4)] == [8] * 4  # 3 tool turns + 4 model turns + 1


async def test_a_run_whose_server_dies_on_its_third_call_keeps_its_two_calls(
    model: Path, sqlite_url: str
) -> None:
    cfg = config(model, sqlite_url, TOOL_AGENT, *FOUR_TURNS)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    _, out = await generate(cfg, model, {7: "tools2_crash"}, step=7)
    batch, _ = await ledger_view(sqlite_url, "train", 7, pad, response_width=LONG)
    assert placeholders(out) == [7]
    assert out.non_tensor_batch["failure_reason"][7] == "runner_error"
    calls = await _calls(sqlite_url, 7)
    sessions = await _sessions(sqlite_url, 7)
    (failed,) = [sid for sid, s in sessions.items() if s["state"] == "failed"]
    assert [c["outcome"] for c in calls[failed]] == ["recorded", "recorded", "failed"]
    assert calls[failed][2]["error_type"] == "RuntimeError"
    assert all(c["response_tokens"] > 0 for c in calls[failed][:2])
    assert sessions[failed]["failure_reason"] == "runner_error"
    assert_same_rows(out, batch)


async def test_versions_reach_the_batch_and_verls_staleness_lines_agree(
    model: Path, sqlite_url: str
) -> None:
    """Step 9 trains on weights 8 (verl V1 stamps the weights it syncs at the end of step n with
    n); rows 0-1 (tool conversations, two calls) and 8 (one call) got their first answer from
    weights 7. Rows 0-1 span the update (versions 7..8), row 8 is one step stale (7..7), every
    other row is on-policy (8..8); verl V1's own staleness lines on the ledger's version columns
    give the ledger's figures."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    cfg = config(model, sqlite_url, TOOL_AGENT)
    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    batch_in = llm.prompt_batch(PROMPTS, N, step=9)
    server = llm.TinyPolicyServer(model, {0: "tool", 1: "tool"}, global_step=8, spanning=(0, 1, 8))
    client = llm.llm_client(cfg, llm.InProcessHandle(server))
    worker = AgentLoopWorker(cfg, client, reward_loop_worker_handles=llm.reward_handles(cfg))
    out = await worker.generate_sequences(batch_in)
    batch, metrics = await ledger_view(sqlite_url, "train", 9, pad)
    lows = np.asarray(non_tensor(batch, "min_global_steps"))
    highs = np.asarray(non_tensor(batch, "max_global_steps"))
    uids, index = non_tensor(batch, "uid"), non_tensor(batch, "session_index")
    versions = {(uid, int(i)): (lo, hi) for uid, i, lo, hi in zip(uids, index, lows, highs)}
    expected = {key: (8, 8) for key in versions}
    expected.update({("p9u0", 0): (7, 8), ("p9u0", 1): (7, 8), ("p9u2", 0): (7, 7)})
    assert versions == expected
    # verl's own row versions (its tool loop keeps the first answer's min and the last max)
    theirs = out.non_tensor_batch
    assert sorted(zip(theirs["min_global_steps"], theirs["max_global_steps"])) == sorted(
        zip(lows.tolist(), highs.tolist())
    )
    namespace: dict[str, Any] = {
        "np": np,
        "metrics": {},
        "global_steps": 9,
        "min_global_steps": lows.astype(int),
        "max_global_steps": highs.astype(int),
    }
    exec(_verl_block(), namespace)  # noqa: S102 - verl's own installed source
    for key, value in namespace["metrics"].items():
        assert metrics[key] == pytest.approx(float(value)), key
    assert metrics["ledger/train/all/off_policy/rows_spanning_updates"] == 2
