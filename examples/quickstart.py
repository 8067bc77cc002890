"""Record one validation step (2 prompts x 4 sessions, one failing), then read its batch and metrics."""

import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from sessions import Ledger, SandboxError, SessionHandle

GROUP_SIZE = (
    4  # sessions per prompt (uid): `ledger.batch` waits until all 4 of every group have ended
)
PROMPT_7 = [101, 2054, 2003, 1016, 1009, 1016, 102]  # token ids, as a tokenizer would give them
PROMPT_8 = [101, 2054, 2003, 1017, 1008, 1017, 102]


def agent(
    prompt_ids: list[int], response_ids: list[int], reward: float
) -> Callable[[SessionHandle], Awaitable[None]]:
    """A runner: an async function given the session's handle (a real one would sample the policy)."""

    async def runner(s: SessionHandle) -> None:
        mask = [1] * len(
            response_ids
        )  # 1 = trainable token; tool output inside a response would be 0
        await s.record_trajectory(
            prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask, num_turns=1
        )
        await s.post_reward(reward, acc=reward)

    return runner


async def broken_sandbox(s: SessionHandle) -> None:
    raise SandboxError(
        "the code sandbox died"
    )  # recorded as failed (sandbox_error), with a placeholder row


PLAN = [  # (uid, session_index, runner); prompt-7's session 0 is recorded by hand in main()
    ("prompt-7", 1, agent(PROMPT_7, [1018, 102], 1.0)),
    ("prompt-7", 2, broken_sandbox),
    ("prompt-7", 3, agent(PROMPT_7, [1019, 102], 0.0)),
    ("prompt-8", 0, agent(PROMPT_8, [1023, 102], 0.0)),
    ("prompt-8", 1, agent(PROMPT_8, [1020, 102], 1.0)),
    ("prompt-8", 2, agent(PROMPT_8, [1020, 1012, 102], 1.0)),
    ("prompt-8", 3, agent(PROMPT_8, [1021, 102], 0.0)),
]


async def main(db: Path) -> None:
    async with Ledger.open(f"sqlite+aiosqlite:///{db}") as ledger:  # creates and migrates the file
        step = dict(group_size=GROUP_SIZE, partition="val", global_step=3)
        # A session as a context: normal exit succeeds; an Exception fails it (+ placeholder) and re-raises.
        async with ledger.session("s-7-0", uid="prompt-7", session_index=0, **step) as s:
            await s.record_trajectory(
                prompt_ids=PROMPT_7, response_ids=[1018, 102], response_mask=[1, 1]
            )
            await s.post_reward(1.0, acc=1.0)
        # run_session: the runner's failure or timeout is recorded and reported in the outcome, never raised.
        for uid, index, runner in PLAN:
            outcome = await ledger.run_session(
                runner, f"s-{uid[-1]}-{index}", uid=uid, session_index=index, timeout=600, **step
            )
            print(f"{outcome.session_id}: {outcome.state} {outcome.failure_reason or ''}".rstrip())

        batch = await ledger.batch(
            "val", 3, timeout=10
        )  # a TensorDict, once every group of the step has ended
        print(
            f"batch: {batch.batch_size[0]} rows, input_ids {tuple(batch['input_ids'].shape)}, "
            f"{int(batch['is_placeholder'].sum())} placeholder"
        )
        for row in await ledger.metrics("val", 3):  # failures count as reward 0 in reward/mean
            print(f"  {row.metric} = {row.value:g}")


if (
    __name__ == "__main__"
):  # python examples/quickstart.py [NEW_FILE.db]  (default: a temporary folder)
    with tempfile.TemporaryDirectory() as folder:
        db = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(folder) / "quickstart.db"
        if db.exists():  # the session ids above are fixed, and a database holds each id once
            sys.exit(f"{db} exists; give quickstart a new file")
        asyncio.run(main(db))
