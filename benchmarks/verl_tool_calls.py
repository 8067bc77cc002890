"""A verl tool-agent step recorded call by call: the example docs/verl.md's "Model calls" shows.
Needs the verl environment (``pip install -e '.[verl,test]'`` in a clone; verl 0.9.1's pins)::

    python -m benchmarks.verl_tool_calls [--db calls.db]

verl 0.9.1's own ``AgentLoopWorker.generate_sequences`` and ``ToolAgentLoop`` run in this process
on CPU, 4 prompts x 4 runs at step 9, under the ledger's agent loop, against the tests' stand-in
LLM server (a tiny local torch policy; nothing is downloaded). Row 7's conversation makes two tool
calls and the server dies on its third call. Step 9 trains on weights 8 (verl V1 stamps the
weights it syncs at the end of step n with n); rows 0 and 1 make a tool call answered by weights 7
and finish on weights 8 (a weight update mid-rollout). Printed: the killed session's
``rollout-ledger history``, the step's ``model_calls`` rows for it, and the step's staleness
figures from the ledger beside verl V1's own lines run on the ledger's version columns, then the
same step read with ``max_staleness=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

STEP = 9
FAULTS = {0: "tool", 1: "tool", 7: "tools2_crash"}
SPANNING = (0, 1)


async def run(db: Path) -> int:
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from sessions import Ledger
    from sessions.batches import non_tensor
    from tests.integrations.verl import llm_server as llm
    from tests.integrations.verl import test_agent_loop as t
    from tests.projection.test_off_policy import _verl_block

    model = llm.build_model_folder(Path(tempfile.mkdtemp(prefix="tiny-policy-")))
    url = f"sqlite+aiosqlite:///{db}"
    cfg = t.config(
        model,
        url,
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        "actor_rollout_ref.rollout.response_length=192",
    )
    server = llm.TinyPolicyServer(model, FAULTS, global_step=STEP - 1, spanning=SPANNING)
    client = llm.llm_client(cfg, llm.InProcessHandle(server))
    worker = AgentLoopWorker(cfg, client, reward_loop_worker_handles=llm.reward_handles(cfg))
    prompts = llm.prompt_batch(t.PROMPTS, t.N, step=STEP)
    uids = prompts.non_tensor_batch["uid"].copy()
    out = await worker.generate_sequences(prompts)
    out.non_tensor_batch["uid"] = uids  # as verl's trainer keeps them beside the output
    pad = server.tokenizer.pad_token_id
    batch, metrics = await t.ledger_view(url, "train", STEP, pad, response_width=192)
    t.assert_same_rows(out, batch)
    print(f"step {STEP}: {len(out)} rows; placeholders at rows {t.placeholders(out)}")
    print("the ledger's batch equals verl's DataProto row for row (every tensor column)\n")

    with sqlite3.connect(db) as connection:
        (failed,) = connection.execute(
            "SELECT session_id FROM sessions WHERE state = 'failed' AND global_step = ?", (STEP,)
        ).fetchone()
        calls = connection.execute(
            "SELECT call_id, turn, outcome, prompt_tokens, response_tokens, min_version, "
            "max_version, finish_reason, error_type FROM model_calls WHERE session_id = ? "
            "ORDER BY started_position",
            (failed,),
        ).fetchall()
    print(f"$ rollout-ledger history --db {db.name} {failed}")
    subprocess.run(
        [sys.executable, "-m", "sessions.cli", "history", "--db", str(db), failed], check=True
    )
    print(f"\nmodel_calls of {failed}:")
    header = (
        "call_id",
        "turn",
        "outcome",
        "prompt",
        "response",
        "min_v",
        "max_v",
        "finish",
        "error",
    )
    print(" ".join(f"{h:<9}" for h in header))
    for row in calls:
        print(" ".join(f"{'' if v is None else v!s:<9}" for v in row).rstrip())

    lows = np.asarray(non_tensor(batch, "min_global_steps"))
    highs = np.asarray(non_tensor(batch, "max_global_steps"))
    known = np.array([lo is not None for lo in lows])
    namespace = {
        "np": np,
        "metrics": {},
        "global_steps": STEP,
        "min_global_steps": lows[known].astype(int),
        "max_global_steps": highs[known].astype(int),
    }
    exec(_verl_block(), namespace)  # noqa: S102 - verl's own installed source
    print(f"\n{'staleness figure':<52} {'verl V1':>8} {'ledger':>8}")
    differ = 0
    for key, value in sorted(namespace["metrics"].items()):
        differ += abs(float(value) - metrics[key]) > 1e-9
        print(f"{key:<52} {float(value):>8.4f} {metrics[key]:>8.4f}")
    for key in ("rows_with_versions", "rows_spanning_updates"):
        name = f"ledger/train/all/off_policy/{key}"
        print(f"{name:<52} {'':>8} {metrics[name]:>8.0f}")

    async with Ledger.open(url, run=t.RUN) as ledger:
        bounded = await ledger.metrics_dict("train", STEP, timeout=10, max_staleness=0)
        rows = await ledger.batch("train", STEP, timeout=10, max_staleness=0)
    print(
        f"\nmax_staleness=0: {rows.batch_size[0]} rows kept; "
        f"ledger/train/all/left_out/stale = {bounded['ledger/train/all/left_out/stale']:.0f}, "
        f"stale_share = {bounded['ledger/train/all/left_out/stale_share']:.4f}"
    )
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=None, help="SQLite file (default: a temp one)")
    args = parser.parse_args()
    db = args.db or Path(tempfile.mkdtemp(prefix="verl-calls-")) / "calls.db"
    if db.exists():
        parser.error(f"--db {db} exists: pass a new file, so the step is recorded once")
    return asyncio.run(run(db))


if __name__ == "__main__":
    raise SystemExit(main())
