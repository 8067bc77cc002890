"""tensordict ``NonTensorStack`` columns: built fast (12 per batch x B rows), read back as lists.

A column is a ``ColumnStack``: a ``NonTensorStack`` that keeps its values as one list and makes
its per-row ``NonTensorData`` members only when something asks for them (tensordict indexing,
``torch.cat``, verl's ``DataProto.from_tensordict``, pickling). ``non_tensor`` and so
``to_data_proto`` read the list itself, so a batch that goes from ``build_padded`` to a
``DataProto`` through this package never makes the 2 x 15 x B member objects at all: they were
~35% of ``build_padded`` (1.1 us a member). Neither tensordict (0.10.0, 0.15.3) nor verl 0.9.1 has
a columnar non-tensor type to use instead: a ``NonTensorData`` of batch size [B] is one value
shared by every row (``tests/batches/test_non_tensor_stacks.py``), and verl reads a per-row
column only from a ``NonTensorStack``'s members.

When members are made, they are the objects tensordict's own constructors make, built directly
with the cyclic GC paused and the objects then moved past the young generations unscanned
(``built_as_old``), after checking once that they match this tensordict version's own.
"""

from __future__ import annotations

import copyreg
from collections import deque
from itertools import repeat
from typing import Any, Iterable, Iterator, Mapping

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from sessions.batches.tensordict_compat import set_stack
from sessions.errors import InvalidArgument, InvalidArgumentType
from sessions.gc_pause import built_as_old

#: Plain scalars: what ``meta`` columns hold (numpy scalars are turned into these first).
SCALAR_TYPES = frozenset((str, int, float, bool, bytes, type(None)))
#: Values the direct builder takes (anything else goes through ``NonTensorStack.from_list``):
#: scalars and dicts (``multi_modal_inputs`` holds one per row, tensordict wraps it as is)
_DIRECT_TYPES = SCALAR_TYPES | {dict}

_EMPTY_SIZE = torch.Size([])
_new, _setattr = object.__new__, object.__setattr__


def _consume(calls: Iterator[Any]) -> None:
    """Run a lazy ``map`` of calls to the end, keeping none of their results."""
    deque(calls, maxlen=0)


def _set_each(objects: list[Any], name: str, values: Iterable[Any]) -> None:
    """``object.__setattr__(obj, name, value)`` for each pair, looped in C rather than bytecode."""
    _consume(map(_setattr, objects, repeat(name), values))


def _direct_members(values: list[Any]) -> list[NonTensorData]:
    """One ``NonTensorData`` (around an empty ``TensorDict``) per value, as ``from_list`` makes it.

    Attributes are set as tensordict's own fast path sets them, in its order (instances of one
    class then share their attribute layout), one attribute at a time over all members: each
    pass is a ``map`` the interpreter runs in C, so no bytecode runs per member but the
    comprehensions building each member's own dicts. Not ``__dict__`` assignment: that makes
    every later attribute read of the member (``tolist``, verl's ``elem.data``) slower.
    """
    n = len(values)
    inners = list(map(_new, repeat(TensorDict, n)))
    _set_each(inners, "_device", repeat(None, n))
    _set_each(inners, "_tensordict", [{} for _ in range(n)])
    _set_each(inners, "_batch_size", repeat(_EMPTY_SIZE, n))
    _set_each(inners, "_td_dim_names", repeat(None, n))
    members = list(map(_new, repeat(NonTensorData, n)))
    _set_each(members, "_tensordict", inners)
    states = [{"data": value, "_metadata": None, "_is_non_tensor": True} for value in values]
    _set_each(members, "_non_tensordict", states)
    _set_each(members, "_is_initialized", repeat(True, n))
    return members


def _direct_stack(values: list[Any]) -> NonTensorStack:
    """``NonTensorStack.from_list(values)`` for scalars and dicts, built without constructors."""
    members = _direct_members(values)
    stack = _new(NonTensorStack)
    for name, attr in _STACK_ATTRIBUTES:
        _setattr(stack, name, attr)
    _setattr(stack, "_batch_size", torch.Size([len(members)]))
    _setattr(stack, "tensordicts", members)
    return stack


def _stack_attributes() -> tuple[tuple[str, Any], ...]:
    """The attributes tensordict's own ``from_list`` gives a stack, but its size and members.

    Probed, because their names differ between versions (``_hook_in`` in 0.15.3, ``hook_in`` in
    0.10.0). Only immutable values are copied into every stack built; with any other the
    attributes of 0.15.3 are used, which ``_direct_build_matches`` then finds do not match.
    """
    fallback = (("_is_locked", None), ("stack_dim", 0), ("_hook_out", None), ("_hook_in", None))
    try:
        state = vars(NonTensorStack.from_list([""]))
    except Exception:  # another tensordict layout: the probe of the direct build decides
        return fallback
    attrs = tuple((k, v) for k, v in state.items() if k not in ("_batch_size", "tensordicts"))
    if all(v is None or type(v) in (int, bool, str) for _, v in attrs):
        return attrs
    return fallback


_STACK_ATTRIBUTES = _stack_attributes()


def _same_state(a: Any, b: Any) -> bool:
    """Same types and instance attributes, through stack members and inner TensorDicts."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if not isinstance(a, TensorDictBase):
        return bool(a == b)
    state_a, state_b = vars(a), vars(b)
    return state_a.keys() == state_b.keys() and all(
        _same_state(state_a[k], state_b[k]) for k in state_a
    )


def _direct_build_matches() -> bool:
    """Whether the direct builders reproduce this tensordict version's own objects exactly."""
    probe = ["a", 1, 2.5, True, b"x", None, {}, {"k": 1}]
    try:
        return _same_state(_direct_stack(probe), NonTensorStack.from_list(probe))
    except Exception:  # another tensordict layout: use its constructors
        return False


_DIRECT_STACKS = _direct_build_matches()


class ColumnStack(NonTensorStack):
    """A ``NonTensorStack`` whose members are made from its column's list on first use.

    Until then its state is a plain stack's with ``_column`` (the values) in place of
    ``tensordicts``; afterwards it is exactly a plain stack's (the list is dropped, the members
    are the one truth, whatever is done to them). Pickling, ``copy`` and ``torch.save`` write a
    plain ``NonTensorStack``, so a saved batch loads without this package.
    """

    @property
    def tensordicts(self) -> list[NonTensorData]:  # type: ignore[override]
        state = self.__dict__
        members = state.get("tensordicts")
        if members is None:
            with built_as_old():
                members = state.setdefault("tensordicts", _direct_members(state["_column"]))
            state.pop("_column", None)
        return members

    @tensordicts.setter
    def tensordicts(self, members: list[NonTensorData]) -> None:
        self.__dict__["tensordicts"] = members
        self.__dict__.pop("_column", None)

    def column(self) -> list[Any] | None:
        """The values, while no member has been made (then the members hold them)."""
        return self.__dict__.get("_column")

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A plain ``NonTensorStack``'s reduction, with the members made.

        Through ``copyreg._reconstructor`` rather than ``__newobj__``, which pickle refuses for
        an object of another class than the one it makes.
        """
        plain = _new(NonTensorStack)
        self.tensordicts  # noqa: B018 -- make the members: a plain stack holds them
        plain.__dict__.update(self.__dict__)
        reduced = plain.__reduce_ex__(protocol)
        if reduced[0] is copyreg.__newobj__:
            reduced = (copyreg._reconstructor, (NonTensorStack, object, None), *reduced[2:])
        return reduced


def _column_stack(values: list[Any]) -> ColumnStack:
    """A stack holding ``values`` (a copy of the list) as its column, members not yet made."""
    stack = _new(ColumnStack)
    for name, attr in _STACK_ATTRIBUTES:
        _setattr(stack, name, attr)
    _setattr(stack, "_batch_size", torch.Size([len(values)]))
    stack.__dict__["_column"] = list(values)
    return stack


def _lazy_columns_work() -> bool:
    """Whether a column stack, set into a batch as ``set_non_tensor_columns`` sets it, is read
    back unmade, and made gives a plain stack's state and values through tensordict's own
    reads (row, slice, ``tolist``)."""
    probe = ["a", 1, 2.5, True, b"x", None, {}, {"k": 1}]
    try:
        batch = TensorDict({}, batch_size=[len(probe)])
        _set_column(batch, "probe", _column_stack(probe))
        got = batch.get("probe")
        if type(got) is not ColumnStack or got.column() != probe:
            return False
        if batch[1]["probe"] != 1 or batch[2:4].get("probe").tolist() != [2.5, True]:
            return False
        made, plain = vars(got), vars(NonTensorStack.from_list(probe))
        return (
            got.column() is None
            and made.keys() == plain.keys()
            and all(_same_state(made[k], plain[k]) for k in made)
        )
    except Exception:  # another tensordict layout: build the members at once
        return False


def non_tensor_stack(values: list[Any]) -> NonTensorStack:
    """``NonTensorStack.from_list(values)``: a ``ColumnStack`` when every value is a scalar or
    dict, else tensordict's own.

    Why: tensordict's constructor costs ~2 us per element, the direct build ~1.1 us, and a
    batch has 15 non-tensor columns x B rows; the column stack makes none until asked. Both
    are checked once (``_direct_build_matches``, ``_lazy_columns_work``) against this
    tensordict version's own objects; otherwise, or for other values, ``from_list`` is used.
    """
    if _DIRECT_STACKS and values and _DIRECT_TYPES.issuperset(map(type, values)):
        return _column_stack(values) if _LAZY_COLUMNS else _direct_stack(values)
    return NonTensorStack.from_list(list(values))


def _set_column(batch: TensorDictBase, name: str, stack: NonTensorStack) -> None:
    """``set_stack``, but a column stack goes in as tensordict stores a value it has checked.

    ``TensorDict.set`` asks a stack ``_has_names()``, which reads every member (and so would
    make them all); a column stack's members have no names, and its batch size is checked
    here, so it is stored through ``_set_str(..., validated=True)`` (tensordict's own path
    for a checked value) into a plain ``TensorDict`` on no device.
    """
    if type(stack) is ColumnStack and type(batch) is TensorDict and batch.device is None:
        if tuple(stack.batch_size) != tuple(batch.batch_size):
            raise InvalidArgument(
                f"column {name!r}: {list(stack.batch_size)} rows for a batch of "
                f"{list(batch.batch_size)}"
            )
        batch._set_str(name, stack, validated=True, inplace=False, non_blocking=False)
        return
    set_stack(batch, name, stack)


def set_non_tensor_columns(batch: TensorDict, columns: Mapping[str, list[Any]]) -> None:
    """One NonTensorStack per column, built with the cyclic GC paused and then promoted.

    Why the pause: a batch's stacks are 2 x 12 x B new GC-tracked objects, all alive until the
    batch is dropped. With the GC running, the young collections their allocation sets off
    promote them to the oldest generation, which then triggers full collections of the whole
    heap (torch alone is ~350k objects): in the projection benchmark (5 passes over 16 batches
    of ~490 rows) build_padded set off 12 full collections costing 2.5 s without the pause, 2
    costing 0.35 s with it. Why the promotion (``sessions.gc_pause.built_as_old``): left young,
    the first young collection after the build scans every member and the next middle one the
    survivors again, ~40% of the columns' cost in that benchmark (0.05 s of 0.13 s a pass). The block runs no user
    code and makes no cycles. The switch is process-wide: for the few milliseconds of the block
    other threads' garbage waits too, and a thread that turned the GC off inside the block
    would find it on again (never the case in this package).
    """
    with built_as_old():
        stacks = {name: non_tensor_stack(values) for name, values in columns.items()}
    for name, stack in stacks.items():
        _set_column(batch, name, stack)


def _plain_values(stack: NonTensorStack) -> list[Any] | None:
    """``stack.tolist()`` read straight off its members, or None when ``tolist`` must decide.

    Why: tensordict 0.10.0 (verl's pin) spends ~3 us a member in ``tolist`` (0.15.3 reads plain
    members this way itself), and ``to_data_proto``, ``densify`` and ``concat_padded`` read every
    column of a batch through ``non_tensor``. Only a flat stack of plain members qualifies: each
    a ``NonTensorData`` of batch size [] whose inner ``TensorDict`` is neither shared nor
    memory-mapped (those keep their value elsewhere), as tensordict's own ``_is_plain_member``
    asks; any other stack is left to ``tolist``.
    """
    if type(stack) not in _PLAIN_STACKS or stack.stack_dim != 0:
        return None
    if type(stack) is ColumnStack:
        column = stack.column()
        if column is not None:
            return list(column)
    values = []
    append = values.append
    for member in stack.tensordicts:
        if type(member) is not NonTensorData:
            return None
        inner = member._tensordict
        if (
            type(inner) is not TensorDict
            or inner._batch_size
            or inner._is_shared
            or inner._is_memmap
        ):
            return None
        state = member._non_tensordict
        if "data" not in state:
            return None
        append(state["data"])
    return values


_PLAIN_STACKS = (NonTensorStack, ColumnStack)
_LAZY_COLUMNS = _lazy_columns_work()


def non_tensor(batch: TensorDictBase, name: str) -> list[Any]:
    """A non-tensor column as a plain list of length B.

    Handles both a ``NonTensorStack`` (what the builders write) and a single
    ``NonTensorData`` (what ``set_non_tensor`` with a non-list writes), which is broadcast.
    """
    value = batch.get(name)
    if isinstance(value, NonTensorStack):
        values = _plain_values(value)
        return list(value.tolist()) if values is None else values
    if isinstance(value, NonTensorData):
        data = value.data
        if isinstance(data, list) and len(data) == batch.batch_size[0]:
            return list(data)
        return [data] * batch.batch_size[0]
    raise InvalidArgumentType(
        f"column {name!r} is not a non-tensor column ({type(value).__name__})"
    )
