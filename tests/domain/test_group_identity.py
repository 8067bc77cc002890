"""Group identity (docs/design.md §2): a group is (run, partition, global_step, uid), and the database
enforces it at creation — across processes — while a uid reused at a later step is a new group
that projects, batches and exports like any other."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sessions import InvalidInput, Ledger
from sessions.batches import non_tensor
from tests import REPO

ROOT = REPO


async def _succeed(
    ledger: Ledger, sid: str, uid: str, index: int, size: int, step: int | None, reward: float
) -> None:
    async with ledger.session(
        sid, uid=uid, session_index=index, group_size=size, partition="val", global_step=step
    ) as s:
        await s.record_trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5])
        await s.post_reward(reward)


async def test_a_uid_reused_at_later_steps_is_a_new_group_each_time(db_url: str) -> None:
    """Dataset prompt ids as uids: the same uids at steps 0, 1 and 2 give three settled steps,
    each with its own rows, keys, group tags and metrics."""
    async with Ledger.open(db_url) as ledger:
        for step in range(3):
            for uid in ("p1", "p2"):
                for index in range(2):
                    await _succeed(
                        ledger, f"s{step}-{uid}-{index}", uid, index, 2, step, reward=float(step)
                    )
        await ledger.project()
        for step in range(3):
            batch = await ledger.batch("val", step, timeout=10)
            assert batch.batch_size[0] == 4
            assert sorted(non_tensor(batch, "key")) == ["p1_0_0", "p1_1_0", "p2_0_0", "p2_1_0"]
            assert set(non_tensor(batch, "global_step")) == {step}
            assert torch.equal(batch["rm_scores"].sum(-1), torch.full((4,), float(step)))
            metrics = {
                row.metric: row.value
                for row in await ledger.metrics("val", step)
                if row.data_source is None
            }
            assert metrics["groups/total"] == 2 and metrics["groups/finished"] == 2
            assert metrics["reward/mean@2"] == pytest.approx(float(step))
        tags = [(q["global_step"], q["key"]) for q in await _tags(ledger)]
        assert sorted(tags) == [(s, u) for s in range(3) for u in ("p1", "p2")]


async def _tags(ledger: Ledger) -> list[dict]:
    from store import read_models as rm

    async with ledger.engine.connect() as conn:
        out = []
        for step in range(3):
            out += await rm.queue_rows_for(conn, ledger.run, "val", step, kind="tag")
        return out


async def test_a_taken_session_index_is_refused_at_creation_naming_the_sibling(db_url: str) -> None:
    async with Ledger.open(db_url) as ledger:
        await ledger.create_session(
            "first", uid="g", session_index=0, group_size=2, partition="val", global_step=4
        )
        with pytest.raises(InvalidInput) as refused:
            await ledger.create_session(
                "second", uid="g", session_index=0, group_size=2, partition="val", global_step=4
            )
        assert refused.value.field == "session_index"
        assert "'first'" in str(refused.value) and "'second'" in str(refused.value)
        # nothing of it was written, and the group still takes its real second member
        assert await ledger.store.read_stream("second") == []
        await ledger.create_session(
            "third", uid="g", session_index=1, group_size=2, partition="val", global_step=4
        )
        # the same slot at another step, partition or run is another group
        await ledger.create_session(
            "other-step", uid="g", session_index=0, group_size=2, partition="val", global_step=5
        )
        await ledger.create_session(
            "no-step", uid="g", session_index=0, group_size=2, partition="val", global_step=None
        )
        await ledger.create_session(
            "train", uid="g", session_index=0, group_size=2, partition="train", global_step=4
        )
        await ledger.create_session(
            "other-run",
            uid="g",
            session_index=0,
            group_size=2,
            partition="val",
            global_step=4,
            run="another",
        )
        with pytest.raises(InvalidInput):  # a NULL step is one group too
            await ledger.create_session(
                "no-step-2",
                uid="g",
                session_index=0,
                group_size=2,
                partition="val",
                global_step=None,
            )


async def test_a_sibling_with_another_group_size_is_refused_naming_the_first_siblings_size(
    db_url: str,
) -> None:
    async with Ledger.open(db_url) as ledger:
        await ledger.create_session(
            "a", uid="h", session_index=0, group_size=4, partition="train", global_step=0
        )
        with pytest.raises(InvalidInput) as refused:
            await ledger.create_session(
                "b", uid="h", session_index=1, group_size=3, partition="train", global_step=0
            )
        assert refused.value.field == "group_size"
        assert (
            "'a'" in str(refused.value) and "4" in str(refused.value) and "3" in str(refused.value)
        )


async def test_one_refused_creation_among_concurrent_ones_fails_only_itself(db_url: str) -> None:
    """Creations committed in one group commit: the conflicting one is refused, every other lands."""
    async with Ledger.open(db_url) as ledger:

        async def create(i: int) -> str:
            index = 0 if i == 17 else i  # session 17 takes session 0's slot
            await ledger.create_session(
                f"c{i}",
                uid="big",
                session_index=index,
                group_size=40,
                partition="val",
                global_step=1,
            )
            return f"c{i}"

        results = await asyncio.gather(*(create(i) for i in range(40)), return_exceptions=True)
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(refused) == 1 and isinstance(refused[0], InvalidInput), results
        stored = {i for i in range(40) if await ledger.store.read_stream(f"c{i}")}
        # every session but one of c0 and c17 (whichever came second for slot 0) is stored
        assert set(range(1, 40)) - {17} <= stored and len(stored & {0, 17}) == 1


RACER = textwrap.dedent(
    """
    import asyncio, sys
    from sessions import InvalidInput, Ledger

    async def main(url, sid, size):
        async with Ledger.open(url) as ledger:
            try:
                await ledger.create_session(sid, uid="race", session_index=0, group_size=int(size), partition="val", global_step=9)
            except InvalidInput as error:
                print("refused", error.field)
                return
            print("created")

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3)], ids=["same-slot", "other-group-size"])
def test_two_processes_racing_for_one_slot_one_wins(db_url: str, sizes: tuple[int, int]) -> None:
    asyncio.run(_migrate(db_url))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, db_url, f"racer-{i}", str(size)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, size in enumerate(sizes)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    said = sorted(out.strip() for out, _err in outputs)
    field = "session_index" if sizes[0] == sizes[1] else "group_size"
    assert said == ["created", f"refused {field}"], said


async def _migrate(url: str) -> None:
    async with Ledger.open(url):
        pass


async def test_the_demo_with_reused_uids_projects_and_exports_every_step(tmp_path: Path) -> None:
    from sessions.batches import to_plain_dict
    from sessions.cli.demo import DemoConfig, run_demo

    async with Ledger.open(tmp_path / "demo.db", run="reuse") as ledger:
        await run_demo(
            ledger,
            DemoConfig(
                steps=3,
                prompts=3,
                group_size=2,
                fail_rate=0.3,
                cancel_rate=0.0,
                seed=5,
                reuse_uids=True,
            ),
        )
        await ledger.project()
        uids_by_step = []
        for step in range(3):
            plain = to_plain_dict(await ledger.batch("val", step, timeout=30))
            assert len(plain["key"]) == 6 and set(plain["global_step"]) == {step}
            uids_by_step.append(sorted(set(plain["uid"])))
        assert uids_by_step[0] == uids_by_step[1] == uids_by_step[2] and len(uids_by_step[0]) == 3
