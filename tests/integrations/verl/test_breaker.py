"""The circuit breaker inside verl (docs/failures.md "The circuit breaker"): the LLM server's
connection drops on every request of a step (`connection_error`, an infrastructure failure), so
the step ends with placeholders only; the next step's ``generate_sequences`` raises `RunHalted`
with its message, and the trainer side's ``batch`` of the failed step raises it too."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessions import Ledger, RunHalted
from tests.integrations.verl import test_agent_loop as agent_loop_tests
from tests.integrations.verl.test_agent_loop import N, config, generate, placeholders

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

model = agent_loop_tests.model
fresh_process_state = agent_loop_tests.fresh_process_state

BREAKER = "+ledger.circuit_breaker={consecutive: 4, window: null}"


async def test_a_dead_llm_server_halts_the_run_at_the_next_step(
    model: Path, sqlite_url: str
) -> None:
    from sessions.integrations.verl.agent_loop import close_process_ledgers

    cfg = config(model, sqlite_url, BREAKER)
    down = {row: "flaky" for row in range(4 * N)}  # every request's connection drops
    _, out = await generate(cfg, model, down, step=1)
    assert placeholders(out) == list(range(4 * N))  # verl's step completes with placeholders
    with pytest.raises(RunHalted, match="connection_error ×"):
        await generate(cfg, model, down, step=2)
    await close_process_ledgers()
    async with Ledger.open(sqlite_url, run=agent_loop_tests.RUN, migrate=False) as ledger:
        with pytest.raises(RunHalted, match="resume the run with a new launch"):
            await ledger.batch("train", 1, timeout=5)
