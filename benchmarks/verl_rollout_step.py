"""One verl rollout step with injected failures, without and with the ledger's agent loop: the
figures docs/verl.md's "What it changes in verl's numbers" quotes. Needs the verl environment
(``pip install -e '.[verl,test]'`` in a clone; verl 0.9.1 and its pins)::

    python -m benchmarks.verl_rollout_step [--db rollout.db] [--timeout 2]

verl 0.9.1's own ``AgentLoopWorker.generate_sequences`` runs in this process on CPU over 4
prompts x 4 runs with ``single_turn_agent``, verl's reward worker and the tests' stand-in LLM
server (a tiny local torch policy, ``tests/integrations/verl/llm_server.py``; nothing is downloaded). The
server crashes on rows 0, 6 and 13 and hangs on row 9. Printed: what ``generate_sequences`` does
without the ledger loop (the exception) and with it (rows, placeholders and their reasons), then
verl's ``compute_data_metrics`` on verl's rows beside the ledger's ``metrics_dict`` for the same
step, and whether the ledger's batch equals verl's ``DataProto`` row for row.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from pathlib import Path

FAULTS = {0: "crash", 6: "crash", 9: "hang", 13: "crash"}
SHOWN = (
    "critic/score/mean",
    "critic/advantages/max",
    "response_length/mean",
    "response_length/max",
    "prompt_length/mean",
)


async def run(db: Path, timeout: float) -> int:
    from tests.integrations.verl import llm_server as llm
    from tests.integrations.verl import test_agent_loop as t

    model = llm.build_model_folder(Path(tempfile.mkdtemp(prefix="tiny-policy-")))
    url = f"sqlite+aiosqlite:///{db}"

    try:
        await t.generate(t.config(model, None), model, FAULTS, step=1)
        print("without the ledger loop: generate_sequences returned (not expected)")
    except Exception as error:  # noqa: BLE001 - the point is to show what verl raises
        print(f"without the ledger loop: generate_sequences raised {type(error).__name__}: {error}")
        print("  rows returned: 0 of 16")

    cfg = llm.verl_config(
        model,
        [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={_agent_loop_config()}",
            f"+ledger.url={url}",
            f"+ledger.timeout={timeout}",
        ],
    )
    started = time.perf_counter()
    _, out = await t.generate(cfg, model, FAULTS, step=1)
    took = time.perf_counter() - started
    rows = t.placeholders(out)
    reasons = [str(out.non_tensor_batch["failure_reason"][i]) for i in rows]
    print(f"with the ledger loop: {len(out)} rows of 16 in {took:.1f} s")
    print(f"  placeholders at rows {rows}: {', '.join(reasons)}")

    pad = llm.TinyPolicyServer(model).tokenizer.pad_token_id
    batch, metrics = await t.ledger_view(url, "train", 1, pad)
    t.assert_same_rows(out, batch)
    print("  the ledger's batch equals verl's DataProto row for row (every tensor column)")
    theirs = t.verl_train_metrics(out)
    shared = sorted(k for k in metrics if k in theirs)
    differ = [
        k
        for k in shared
        if not (math.isnan(float(theirs[k])) and math.isnan(metrics[k]))
        and abs(float(theirs[k]) - metrics[k]) > 1e-6
    ]
    print(f"\n{'figure':<42} {'verl':>10} {'ledger':>10}")
    for key in (k for k in SHOWN if k in shared):
        print(f"{key:<42} {float(theirs[key]):>10.4f} {metrics[key]:>10.4f}")
    for key in ("reward/mean", "reward/mean_success_only", "sessions/failed", "placeholders"):
        name = f"ledger/train/all/{key}"
        print(f"{name:<42} {'':>10} {metrics[name]:>10.4f}")
    print(f"\nverl's compute_data_metrics vs metrics_dict: {len(shared)} shared figures, ", end="")
    print(f"{len(differ)} differ{': ' + ', '.join(differ) if differ else ''}")
    return 1 if differ else 0


def _agent_loop_config() -> str:
    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG

    return str(AGENT_LOOP_CONFIG)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=None, help="SQLite file (default: a temp one)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per attempt")
    args = parser.parse_args()
    db = args.db or Path(tempfile.mkdtemp(prefix="verl-rollout-")) / "rollout.db"
    if db.exists():
        parser.error(f"--db {db} exists: pass a new file, so the step is recorded once")
    return asyncio.run(run(db, args.timeout))


if __name__ == "__main__":
    raise SystemExit(main())
