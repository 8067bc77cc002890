"""A ledger batch -> verl's ``DataProto``, with the options a verl step needs.

``DataProto.from_tensordict(batch)`` already takes a padded ledger batch as it is. This module
adds what stock verl cannot know from the batch alone:

* **placeholder uid isolation**: stock ``compute_grpo_outcome_advantage`` groups rows by the
  ``uid`` column and keeps a failed session's 0 in its siblings' baseline. Giving each
  placeholder a uid of its own (``{uid}-ph{session_index}``, no ``_``) makes it a group of one
  (mean 0, std 1, score 0 -> advantage 0), so the siblings' advantages equal the reference
  ``grpo_outcome_advantage(batch, exclude_placeholders=True)``. The original uid stays in the
  ``group_uid`` column. On by default for ``train`` batches only: verl's validation metrics group
  by ``uid``, and an isolated placeholder would leave its prompt one value short (``mean@3``).
* **fixed batch size** (``pad_to_multiple``): masked filler rows (``filler``), each with its
  own uid and ``is_padding`` True.
* **fixed widths** (``prompt_width`` / ``response_width``, verl's ``max_prompt_length`` /
  ``max_response_length``): the batch re-padded by ``sessions.batches.pad_to_widths`` first, so
  every step's DataProto has the same shapes and ``DataProto.concat`` takes any of them
  (``Ledger.batch(..., prompt_width=..., response_width=...)`` does the same at the source).

Every DataProto made here has the ``group_uid`` and ``is_padding`` columns, so two steps'
DataProtos have the same columns (``DataProto.concat`` needs that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from sessions.batches import non_tensor, pad_to_widths
from sessions.batches.columns import NON_TENSOR_COLUMNS
from sessions.errors import InvalidArgument, InvalidArgumentType, MissingDependency
from sessions.integrations.verl.filler import IS_PADDING, append_filler_rows
from sessions.placeholder import GROUP_UID, isolated_uid

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = [
    "GROUP_UID",
    "to_data_proto",
]


def _import_data_proto() -> type:
    """verl's ``DataProto``, imported on first use (the ledger installs and runs without verl)."""
    try:
        from verl.protocol import DataProto
    except ImportError as error:
        raise MissingDependency(
            "this needs verl: pip install -e '.[verl]' from a clone of rollout-ledger (verl 0.9.1, which pins tensordict 0.10.0)"
        ) from error
    return DataProto


def _object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array of exactly these values (``np.array`` would make lists into 2-D);
    filled in C (numpy >= 1.23 takes object dtype here), not element by element."""
    return np.fromiter(values, dtype=object, count=len(values))


def _batch_columns(batch: TensorDictBase) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """A padded ledger batch as verl holds it: tensors, and non-tensor columns as 1-D object arrays.

    Every non-tensor column becomes a row column, also one stored as a single ``NonTensorData``
    (``DataProto.from_tensordict`` would move such a column into ``meta_info``).
    """
    if not isinstance(batch, TensorDictBase):
        raise InvalidArgumentType(
            f"expected a ledger batch (a TensorDict from Ledger.batch), got {type(batch).__name__}"
        )
    if len(batch.batch_size) != 1:
        raise InvalidArgument(
            f"a ledger batch has one batch dimension, got batch_size={list(batch.batch_size)}"
        )
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, np.ndarray] = {}
    for key in batch.keys():
        value = batch.get(key)
        if isinstance(value, (NonTensorStack, NonTensorData)):
            non_tensors[key] = _object_array(non_tensor(batch, key))
        elif isinstance(value, torch.Tensor):
            if value.is_nested:
                raise InvalidArgumentType(
                    f"column {key!r} is jagged; verl's trainer takes the padded layout: pass "
                    "sessions.batches.densify(batch) (or take Ledger.batch(..., jagged=False))"
                )
            tensors[key] = value
        else:
            raise InvalidArgumentType(
                f"column {key!r} is a {type(value).__name__}; a ledger batch holds tensors and non-tensor stacks"
            )
    return tensors, non_tensors


def _isolate_placeholder_uids(
    non_tensors: Mapping[str, np.ndarray], is_placeholder: torch.Tensor
) -> np.ndarray:
    """The ``uid`` column with each placeholder row's uid made its own: ``{uid}-ph{session_index}``.

    Raises ``ValueError`` if such a uid is already taken in the batch (a real uid spelt that way,
    or one uid reused across concatenated steps): merging groups there would be silent.
    """
    for name in ("uid", "session_index"):
        if name not in non_tensors:
            raise InvalidArgument(
                f"placeholder uid isolation needs the {name!r} column; the batch has {sorted(non_tensors)}"
            )
    uids = non_tensors["uid"].copy()
    taken = set(uids.tolist())
    for i in np.flatnonzero(is_placeholder.cpu().numpy()):
        isolated = isolated_uid(uids[i], non_tensors["session_index"][i])
        if isolated in taken:
            raise InvalidArgument(
                f"cannot isolate the placeholder of uid {uids[i]!r}: uid {isolated!r} is already in the batch "
                "(a uid spelt like an isolated one, or a uid reused across concatenated steps); convert each "
                "step's batch on its own, or pass isolate_placeholders=False"
            )
        uids[i] = isolated
        taken.add(isolated)
    return uids


def _isolate_by_default(non_tensors: Mapping[str, np.ndarray]) -> bool:
    """Isolation defaults to on for a train batch, off for a val batch; a mixed batch must choose."""
    partitions = set(non_tensors.get("partition", np.empty(0, dtype=object)).tolist())
    if len(partitions) > 1:
        raise InvalidArgument(
            f"the batch mixes partitions {sorted(map(str, partitions))}; pass isolate_placeholders=True "
            "(train: GRPO) or False (val: validation metrics group by uid)"
        )
    return partitions != {"val"}


def to_data_proto(
    batch: TensorDictBase,
    *,
    isolate_placeholders: bool | None = None,
    pad_to_multiple: int | None = None,
    prompt_width: int | None = None,
    response_width: int | None = None,
    pad_token_id: int = 0,
    meta_info: Mapping[str, Any] | None = None,
) -> DataProto:
    """A padded ledger batch (``Ledger.batch(...)``) -> ``verl.protocol.DataProto``.

    Tensor columns go to ``batch`` as they are (no copy), non-tensor columns to
    ``non_tensor_batch`` as 1-D object arrays; ``group_uid`` (the original uid) and
    ``is_padding`` (bool tensor) are added.

    ``isolate_placeholders``: give each placeholder row a uid of its own so stock GRPO keeps it
    out of its siblings' baseline. None (default): on for a ``train`` batch, off for ``val``.
    ``pad_to_multiple``: append masked filler rows until the row count is a multiple of it
    (e.g. lcm(dp size, ppo_mini_batch_size x n), as verl's V1 trainer computes it); drop them
    with ``without_padding`` before ``compute_data_metrics``.
    ``prompt_width`` / ``response_width``: exact padded widths (``pad_to_widths``; a longer row
    raises ``BatchTooLongError``). ``pad_token_id``: the token that padding and filler rows are
    made of. ``meta_info``: passed through; non-tensor columns beyond the ledger's own (the
    ``reward_info`` columns of ``Ledger.batch(reward_info=True)``) are listed in its
    ``reward_extra_keys``, as verl's trainer reads them, unless ``meta_info`` names them.
    """
    DataProto = _import_data_proto()
    if prompt_width is not None or response_width is not None:
        batch = pad_to_widths(batch, prompt_width, response_width, pad_token_id=pad_token_id)
    tensors, non_tensors = _batch_columns(batch)
    size = int(batch.batch_size[0])
    if "is_placeholder" not in tensors:
        raise InvalidArgument(
            "the batch has no 'is_placeholder' column; is it a ledger batch (Ledger.batch)?"
        )
    if "uid" in non_tensors:
        non_tensors[GROUP_UID] = non_tensors["uid"].copy()
        isolate = (
            _isolate_by_default(non_tensors)
            if isolate_placeholders is None
            else isolate_placeholders
        )
        if isolate:
            non_tensors["uid"] = _isolate_placeholder_uids(non_tensors, tensors["is_placeholder"])
    elif isolate_placeholders:
        raise InvalidArgument("isolate_placeholders=True needs the batch's 'uid' column")
    tensors[IS_PADDING] = torch.zeros(size, dtype=torch.bool)
    if pad_to_multiple is not None:
        tensors, non_tensors, size = append_filler_rows(
            tensors, non_tensors, multiple=pad_to_multiple, pad_token_id=pad_token_id
        )
    meta = dict(meta_info or {})
    extra = sorted(set(non_tensors) - set(NON_TENSOR_COLUMNS) - {GROUP_UID})
    if extra and "reward_extra_keys" not in meta:
        # the batch's reward_info columns (`Ledger.batch(reward_info=True)`): verl reads its
        # validation's per-key lists from these non-tensor columns
        meta["reward_extra_keys"] = extra
    return DataProto(
        batch=TensorDict(tensors, batch_size=[size]),
        non_tensor_batch=non_tensors,
        meta_info=meta,
    )
