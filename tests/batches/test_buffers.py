"""build_padded's output memory is reused across steps only once nothing holds the earlier batch
(sessions/batches/buffers.py's ownership rule)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from sessions.batches import build_padded
from sessions.batches.buffers import empty_column, release_buffers
from sessions.batches.collect import BatchRow

BIG = (512, 1024)  # 4 MiB of int64: above the pool's threshold


def rows(n: int = 64, length: int = 3000, fill: int = 7) -> list[BatchRow]:
    return [
        BatchRow(
            prompt_ids=np.full(100, fill, np.int32),
            response_ids=np.full(length, fill, np.int32),
            response_mask=np.ones(length, np.uint8),
            logprobs=None,
            reward=1.0,
            is_placeholder=False,
            meta={"uid": f"u{i}"},
        )
        for i in range(n)
    ]


@pytest.fixture(autouse=True)
def _fresh_pool() -> None:
    release_buffers()
    yield
    release_buffers()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_dropped_batch_gives_its_memory_to_the_next() -> None:
    first = build_padded(rows(fill=7))
    address = _ptr(first["responses"])
    del first
    gc.collect()
    second = build_padded(rows(fill=9))
    assert _ptr(second["responses"]) == address
    assert bool((second["responses"][:, :3000] == 9).all())


def test_a_held_batch_is_never_written() -> None:
    first = build_padded(rows(fill=7))
    expected = first["responses"].clone()
    second = build_padded(rows(fill=9))
    third = build_padded(rows(fill=11))
    assert torch.equal(first["responses"], expected)
    assert _ptr(first["responses"]) not in {_ptr(second["responses"]), _ptr(third["responses"])}


@pytest.mark.parametrize("hold", ["view", "numpy", "dlpack", "storage"])
def test_anything_left_of_a_column_keeps_its_memory(hold: str) -> None:
    tensor = empty_column("x", BIG, torch.int64)
    tensor.fill_(5)
    kept = {
        "view": lambda t: t[3],
        "numpy": lambda t: t.numpy(),
        "dlpack": lambda t: np.from_dlpack(t),
        "storage": lambda t: t.untyped_storage(),
    }[hold](tensor)
    address = _ptr(tensor)
    del tensor
    again = empty_column("x", BIG, torch.int64)
    assert _ptr(again) != address
    again.fill_(6)
    if hold == "storage":
        assert torch.tensor([], dtype=torch.int64).set_(kept).view(-1)[0].item() == 5
    else:
        assert int(np.asarray(kept).reshape(-1)[0]) == 5


def test_small_columns_and_shared_memory_are_not_kept() -> None:
    small = empty_column("y", (4, 4), torch.int64)
    address = _ptr(small)
    del small
    assert empty_column("y", (4, 4), torch.int64) is not None  # a plain allocation
    shared = empty_column("z", BIG, torch.int64)
    shared.share_memory_()
    address = _ptr(shared)
    del shared
    assert _ptr(empty_column("z", BIG, torch.int64)) != address
