"""The non-tensor columns of a padded batch: built in bulk and promoted past the young
GC generations, yet the same objects as tensordict's own, read back per row through every path a
verl step takes (tensordict split / cat / index, ``DataProto.from_tensordict`` and its
``split`` / ``chunk``, ``to_data_proto``), equal to the per-row baseline on generated rows.

Why the representation stays a ``NonTensorStack`` (a ``ColumnStack`` that makes its one
``NonTensorData`` per row late, tested at the end of this file): verl 0.9.1
reads a per-row column only from a ``NonTensorStack`` (``DataProto.from_tensordict`` turns a
``NonTensorData`` into ``meta_info``), and tensordict reads a ``NonTensorData`` of any batch size
as one value for every row. ``test_a_single_non_tensor_data_is_not_a_per_row_column`` pins that
down, so a change in either shows here.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import tensordict
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from benchmarks.projection import check_same, per_row_padded
from sessions.batches import NON_TENSOR_COLUMNS, BatchRow, build_padded, non_tensor, split_batch
from sessions.batches import non_tensor_stacks as stacks_module
from sessions.batches.tensordict_compat import NATIVE_EMPTY_SELECTION
from sessions.errors import InvalidArgument
from tests.batches.strategies import rows
from tests.batches.test_padded import SCALARS

pytestmark = pytest.mark.verl_env  # also under verl's pin, tensordict 0.10.0

EXAMPLES = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VALUES = st.lists(
    SCALARS | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    min_size=1,
    max_size=8,
)


def one_row(uid: str = "u") -> BatchRow:
    return BatchRow(np.array([1]), np.array([2]), np.array([1]), None, 1.0, False, {"uid": uid})


def in_generation(objects: list[Any], generation: int) -> bool:
    """Whether any of ``objects`` is tracked in that GC generation (by identity)."""
    ids = {id(o) for o in objects}
    return any(id(o) in ids for o in gc.get_objects(generation))


# ----------------------------------------------------------------------------- the objects
@settings(max_examples=40, deadline=None)
@given(values=VALUES)
def test_members_have_tensordicts_attributes_in_its_order(values: list[Any]) -> None:
    """Same state as ``from_list`` and the same attribute order (instances of one class then
    share one attribute layout, which keeps later reads of them as fast as of tensordict's)."""
    ours, theirs = stacks_module.non_tensor_stack(values), NonTensorStack.from_list(list(values))
    assert isinstance(ours, NonTensorStack)
    ours.tensordicts  # noqa: B018 -- make the column stack's members
    assert vars(ours).keys() == vars(theirs).keys()
    assert all(stacks_module._same_state(vars(ours)[k], vars(theirs)[k]) for k in vars(ours))
    for mine, its in zip(ours.tensordicts, theirs.tensordicts):
        assert list(vars(mine)) == list(vars(its))
        assert list(vars(mine._tensordict)) == list(vars(its._tensordict))
    assert ours.tolist() == values
    ours[0] = "changed"  # members are separate objects: a write reaches one row only
    assert ours.tolist() == ["changed", *values[1:]]


def test_a_single_non_tensor_data_is_not_a_per_row_column() -> None:
    """The evidence against a columnar form: one NonTensorData holding the column's values
    is one value for all rows in tensordict (every row, slice and split sees the whole list)."""
    column = ["a", "b", "c", "d"]
    batch = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    batch.set("s", NonTensorData(column, batch_size=[4]))
    assert batch[1]["s"] == column
    assert batch[1:3]["s"] == column
    assert [part["s"] for part in batch.split(2)] == [column, column]


# -------------------------------------------------------------------------- GC promotion
def test_built_columns_skip_the_young_generations() -> None:
    batch = build_padded([one_row(), one_row("v")])
    members = [m for name in NON_TENSOR_COLUMNS for m in batch.get(name).tensordicts]
    inner = [m._tensordict for m in members]
    assert not in_generation(members + inner, 0)
    assert not in_generation(members + inner, 1)
    assert in_generation(members[:1], 2)


def test_objects_someone_froze_stay_frozen() -> None:
    """With frozen objects in the process, the columns are only built with the GC paused."""
    was = gc.isenabled()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        batch = build_padded([one_row()])
        # neither unfrozen (0) nor frozen further (more); a frozen object another thread lets go
        # of meanwhile leaves the permanent generation, so the count may fall a little
        assert 0 < gc.get_freeze_count() <= frozen
        assert gc.isenabled() is was
        assert non_tensor(batch, "uid") == ["u"]
    finally:
        gc.unfreeze()


@pytest.fixture
def freezes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records each ``gc.freeze()`` call (still made)."""
    calls: list[int] = []
    freeze = gc.freeze

    def recorded() -> None:
        calls.append(1)
        freeze()

    monkeypatch.setattr(gc, "freeze", recorded)
    return calls


def test_the_promotion_is_one_freeze_per_batch(freezes: list[int]) -> None:
    build_padded([one_row()])
    assert len(freezes) == 1 and gc.get_freeze_count() == 0  # unfrozen again


def test_a_failing_block_promotes_nothing_and_restores_the_gc(freezes: list[int]) -> None:
    with pytest.raises(RuntimeError):
        with stacks_module.built_as_old():
            NonTensorStack.from_list(["a"])
            raise RuntimeError("boom")
    assert gc.isenabled()
    assert freezes == []


def test_with_the_gc_off_it_stays_off_and_nothing_is_promoted(freezes: list[int]) -> None:
    gc.disable()
    try:
        batch = build_padded([one_row()])
        assert not gc.isenabled()
        assert freezes == []
        assert not in_generation(batch.get("uid").tensordicts, 2)  # no collection ran: still young
    finally:
        gc.enable()


# ------------------------------------------------------------ per-row values, every path
@EXAMPLES
@given(batch_rows=rows(min_size=1), data=st.data())
def test_splits_as_tensordict_and_verl_make_them_keep_the_baselines_rows(
    batch_rows: list[BatchRow], data: Any
) -> None:
    expected, found = per_row_padded(batch_rows), build_padded(batch_rows)
    size = data.draw(st.integers(1, len(batch_rows)))
    for part_expected, part_found in zip(expected.split(size), found.split(size), strict=True):
        check_same(part_expected, part_found)
    for part_expected, part_found in zip(
        split_batch(expected, size), split_batch(found, size), strict=True
    ):
        check_same(part_expected, part_found)
    check_same(torch.cat(list(expected.split(size))), found)


@EXAMPLES
@given(batch_rows=rows(min_size=1), data=st.data())
def test_verl_reads_the_baselines_rows(
    verl_installed: None, batch_rows: list[BatchRow], data: Any
) -> None:
    """DataProto.from_tensordict, its mini-batch split and chunk, and to_data_proto, each on the
    built batch and on the per-row baseline: the same object arrays."""
    from verl import DataProto

    from sessions.integrations.verl import to_data_proto

    expected, found = per_row_padded(batch_rows), build_padded(batch_rows)
    dp_expected, dp_found = DataProto.from_tensordict(expected), DataProto.from_tensordict(found)
    assert_same_non_tensor_batch(dp_expected, dp_found)
    size = data.draw(st.integers(1, len(batch_rows)))
    for part_expected, part_found in zip(
        dp_expected.split(size), dp_found.split(size), strict=True
    ):
        assert_same_non_tensor_batch(part_expected, part_found)
    for part_expected, part_found in zip(dp_expected.chunk(1), dp_found.chunk(1), strict=True):
        assert_same_non_tensor_batch(part_expected, part_found)
    assert_same_non_tensor_batch(to_data_proto(expected), to_data_proto(found))
    for name in NON_TENSOR_COLUMNS:
        assert dp_found.non_tensor_batch[name].tolist() == non_tensor(found, name), name


def assert_same_non_tensor_batch(expected: Any, found: Any) -> None:
    assert sorted(expected.non_tensor_batch) == sorted(found.non_tensor_batch)
    for name, values in expected.non_tensor_batch.items():
        column = found.non_tensor_batch[name]
        assert column.dtype == values.dtype == object and column.shape == values.shape, name
        assert column.tolist() == values.tolist(), name


# ------------------------------------------------------------------ reading the columns
@EXAMPLES
@given(batch_rows=rows(min_size=1), data=st.data())
def test_non_tensor_reads_what_tolist_reads(batch_rows: list[BatchRow], data: Any) -> None:
    """The direct read of plain members gives tolist()'s list, also after indexing, cat and a write."""
    batch = build_padded(batch_rows)
    ids = data.draw(st.lists(st.integers(0, len(batch_rows) - 1), min_size=1, max_size=6))
    picked = batch[torch.tensor(ids)]
    joined = torch.cat([batch, picked])
    joined["uid"][0] = "written"
    sources = [batch, picked, joined] + (
        [batch[1:]] if len(batch_rows) > 1 or NATIVE_EMPTY_SELECTION else []
    )
    for source in sources:
        for name in NON_TENSOR_COLUMNS:
            assert non_tensor(source, name) == list(source.get(name).tolist()), name
    assert non_tensor(joined, "uid")[0] == "written"


def test_stacks_of_other_members_are_read_by_tolist() -> None:
    """A nested list member, a memory-mapped or a shared batch keeps its values elsewhere: tolist."""
    nested = TensorDict({}, batch_size=[2])
    nested.set("s", NonTensorStack.from_list([["w", "x"], ["y", "z"]]))
    assert stacks_module._plain_values(nested.get("s")) is None
    assert non_tensor(nested, "s") == [["w", "x"], ["y", "z"]]
    batch = build_padded([one_row("a"), one_row("b")])
    shared = batch.clone().share_memory_()
    assert stacks_module._plain_values(shared.get("uid")) is None
    assert non_tensor(shared, "uid") == ["a", "b"]


# ------------------------------------------------------------------------ column stacks
def test_column_stacks_are_in_use_on_the_tensordict_they_were_measured_on() -> None:
    """Like the direct build: the column stack switches itself off on a tensordict where its
    probe fails; on the newest and verl 0.9.1's pin it must be on."""
    assert stacks_module._LAZY_COLUMNS == stacks_module._lazy_columns_work()
    if tensordict.__version__ in ("0.10.0", "0.15.3"):
        assert stacks_module._LAZY_COLUMNS


def _unmade(batch: TensorDict) -> list[str]:
    return [
        name
        for name in NON_TENSOR_COLUMNS
        if isinstance(batch.get(name), stacks_module.ColumnStack)
        and batch.get(name).column() is not None
    ]


def test_a_batch_read_through_this_package_makes_no_member() -> None:
    """build_padded, ``non_tensor`` and ``to_data_proto`` read the column's list: no per-row
    object is made on that path (what took ~35% of the build)."""
    pytest.importorskip("verl")
    from sessions.integrations.verl.data_proto import to_data_proto

    batch = build_padded([one_row("a"), one_row("b")])
    assert _unmade(batch) == list(NON_TENSOR_COLUMNS)
    assert non_tensor(batch, "uid") == ["a", "b"]
    proto = to_data_proto(batch)
    assert list(proto.non_tensor_batch["uid"]) == ["a", "b"]
    assert _unmade(batch) == list(NON_TENSOR_COLUMNS)


def test_members_are_made_when_tensordict_asks_and_then_are_the_truth() -> None:
    batch = build_padded([one_row("a"), one_row("b")])
    assert batch[1]["uid"] == "b"  # tensordict's row read makes that column's members
    assert "uid" not in _unmade(batch)
    batch["uid"][0] = "changed"
    assert non_tensor(batch, "uid") == ["changed", "b"]


def test_a_pickled_column_stack_is_a_plain_one() -> None:
    """A saved batch loads without this package's class: what is pickled is tensordict's own."""
    import pickle

    stack = stacks_module.non_tensor_stack(["a", 1, None])
    loaded = pickle.loads(pickle.dumps(stack))
    assert type(loaded) is NonTensorStack
    assert loaded.tolist() == ["a", 1, None]
    assert stack.tolist() == ["a", 1, None]  # pickling made the members, values unchanged


def test_a_column_stack_of_the_wrong_size_is_refused() -> None:
    batch = TensorDict({}, batch_size=[3])
    with pytest.raises(InvalidArgument, match="'s': \\[2\\] rows for a batch of \\[3\\]"):
        stacks_module._set_column(batch, "s", stacks_module.non_tensor_stack(["a", "b"]))
