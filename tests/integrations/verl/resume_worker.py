"""The first launch of a verl job for the resume test (`test_resume.py`), as its own process: a
real ``AgentLoopWorker`` runs a train step through the ledger agent loop, and the process dies
(``os._exit``) when the stand-in LLM server is asked for one row, in the middle of the step: that
row's session stays open, the others in whatever state they reached, as when a node is lost.

    python -m tests.integrations.verl.resume_worker URL MODEL_FOLDER STEP
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from tests.integrations.verl import llm_server as llm
from tests.integrations.verl.test_agent_loop import PROMPTS, N, config

#: The row (verl's request number) whose generation kills the worker, and the exit status.
DYING_ROW = 9
EXIT_CODE = 17
LAUNCH = "verl-job-a"


async def main(url: str, model: str, step: int) -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    cfg = config(Path(model), url, f"+ledger.launch={LAUNCH}")
    server = llm.TinyPolicyServer(model, global_step=step)
    generate = server.generate

    async def dying(**request: Any) -> Any:
        if request["request_id"] == f"det-{DYING_ROW}":
            os._exit(EXIT_CODE)  # killed mid-step: nothing of this process runs after
        return await generate(**request)

    server.generate = dying  # type: ignore[method-assign]
    client = llm.llm_client(cfg, llm.InProcessHandle(server))
    worker = AgentLoopWorker(cfg, client, reward_loop_worker_handles=llm.reward_handles(cfg))
    await worker.generate_sequences(llm.prompt_batch(PROMPTS, N, step=step, uid_prefix="a"))
    raise SystemExit("the worker was meant to die mid-step")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
