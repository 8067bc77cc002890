"""Batch ready when the step ends: `ledger.batch` builds a step from the rows its own
projector holds, and that batch is the one built from the rows read back; rows another
projector made after this one's last page are never missed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sessions import Ledger
from sessions.batches.non_tensor_stacks import non_tensor
from sessions.projection.projector import Projector
from tests.projection.test_held_rows import _open_step


def _columns(batch: Any) -> dict[str, Any]:
    """Every column of a batch: tensors as they are, non-tensor columns as lists."""
    out: dict[str, Any] = {}
    for key in batch.keys():
        value = batch.get(key)
        out[key] = value if isinstance(value, torch.Tensor) else non_tensor(batch, key)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize("reward_info", [False, True])
async def test_a_held_step_builds_the_batch_the_rows_read_back_build(
    tmp_path: Path, reward_info: bool
) -> None:
    path = tmp_path / "held.db"
    async with Ledger.open(f"sqlite+aiosqlite:///{path}") as ledger:
        handles = await _open_step(ledger, 12)
        await ledger.project()
        for i, handle in enumerate(handles):
            if i % 5 == 0:
                await handle.fail("sandbox_error")  # placeholders among the rows
            else:
                await handle.complete()
        await ledger.project()
        assert (
            ledger.projector.held_step(ledger.run, "train", 0) is not None
        )  # the batch comes from the hold
        held = _columns(await ledger.batch("train", 0, timeout=5, reward_info=reward_info))
    async with Ledger.open(
        f"sqlite+aiosqlite:///{path}"
    ) as reader:  # a fresh projector: holds nothing
        assert reader.projector.held_step(reader.run, "train", 0) is None
        read_back = _columns(await reader.batch("train", 0, timeout=5, reward_info=reward_info))
    _same(held, read_back)


async def test_a_hold_is_not_used_once_another_projector_wrote_after_it(tmp_path: Path) -> None:
    """Another process may project the step's last events after this projector's last page: the
    hold is then short of them, and only the checkpoint says so."""
    path = tmp_path / "race.db"
    async with Ledger.open(f"sqlite+aiosqlite:///{path}") as ledger:
        handles = await _open_step(ledger, 8)
        await ledger.project()  # holds the step from its first sessions
        for handle in handles:
            await handle.complete()
        elsewhere = Projector(ledger.engine)
        await elsewhere.run()  # projects the ends: the rows this projector holds are short of them
        assert (
            ledger.projector.held_step(ledger.run, "train", 0) is not None
        )  # it has not noticed yet
        async with ledger.engine.connect() as conn:
            assert await ledger.projector.current_held_step(conn, ledger.run, "train", 0) is None
        batch = await ledger.batch("train", 0, timeout=5)
        assert batch.batch_size[0] == 8 and sorted(non_tensor(batch, "key")) == sorted(
            f"u{i // 4}_{i % 4}_0" for i in range(8)
        )
