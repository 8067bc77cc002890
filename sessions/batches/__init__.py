"""Projected rows -> verl-convention torch batches (DESIGN.md section 6).

Two layouts of the same columns (``columns``):

* padded (``build_padded``, ``padded``): what verl's trainer consumes. Prompts are left-padded,
  responses right-padded, ``input_ids = cat(prompts, responses)``, the reward sits on the last
  attended response token of ``rm_scores``.
* jagged (``build_jagged``, ``jagged``): unpadded ``torch.jagged`` nested tensors, what row
  stores such as TransferQueue hold. ``densify`` turns it into the padded layout.

Rows are validated, and truncated if asked, once (``collect``), into per-row arrays the padded
writer copies straight into place. The jagged builder concatenates each column once (the *flat*
form, ``flat``); ``densify`` and ``concat_padded`` (``convert``) reduce any batch to flat and
split it back into per-row views for the same padded writer. ``to_plain_dict`` /
``from_plain_dict`` (``plain``) export a batch as plain tensors and lists.

Non-tensor columns (``NON_TENSOR_COLUMNS``) are stored as ``tensordict.NonTensorStack`` of
length B. ``batch["uid"]`` returns a ``list`` subclass; ``non_tensor(batch, "uid")`` returns a
plain ``list`` and also copes with a column set through ``set_non_tensor``. Indexing, boolean
selection and ``torch.cat`` of batches keep these columns aligned with the rows. A stack is one
``NonTensorData`` object per row, so these 10 columns cost more than the tensor columns; they
are built directly, with the cyclic GC paused (``non_tensor_stacks``).

Decisions recorded here (the contract is silent on them):

* ``rollout_log_probs`` exists iff at least one row carries logprobs; rows without logprobs get
  zeros in it (they are then indistinguishable from logprob 0.0 -- check ``is_placeholder`` or
  keep logprobs on all rows if that matters).
* A row with an empty response (length 0) keeps its reward out of ``rm_scores`` (there is no
  attended response token to put it on). verl reads such a row as "aborted" and excludes it from
  score metrics anyway; the 1+1-token placeholder exists precisely to avoid this case.
* A placeholder row must have an all-zero ``response_mask``; otherwise ``ValueError``.
* An empty ``rows`` sequence gives ``batch_size=[0]`` with every tensor key present and width 0.
  ``torch.cat`` needs equal widths for padded batches, so use ``concat_padded`` to concatenate
  padded batches of different widths (including empty ones); jagged batches with the same keys
  ``torch.cat`` as is (``concat_padded`` also takes them, with or without ``rollout_log_probs``).
* ``meta`` keys outside ``NON_TENSOR_COLUMNS`` are ignored; numpy scalars are turned into Python
  scalars so the columns stay ``torch.load(weights_only=True)``-safe.
"""

from __future__ import annotations

from sessions.batches.collect import BatchRow, BatchTooLongError
from sessions.batches.columns import (
    COLUMN_DTYPES,
    LAYOUT_COLUMNS,
    NON_TENSOR_COLUMNS,
    PROMPT_COLUMNS,
    RESPONSE_COLUMNS,
    ROW_COLUMNS,
    SEQUENCE_COLUMNS,
    TOKEN_COLUMNS,
)
from sessions.batches.convert import concat_padded, densify
from sessions.batches.jagged import build_jagged
from sessions.batches.non_tensor_stacks import non_tensor
from sessions.batches.padded import build_padded
from sessions.batches.plain import from_plain_dict, to_plain_dict

__all__ = [
    "BatchRow",
    "BatchTooLongError",
    "COLUMN_DTYPES",
    "LAYOUT_COLUMNS",
    "NON_TENSOR_COLUMNS",
    "PROMPT_COLUMNS",
    "RESPONSE_COLUMNS",
    "ROW_COLUMNS",
    "SEQUENCE_COLUMNS",
    "TOKEN_COLUMNS",
    "build_jagged",
    "build_padded",
    "concat_padded",
    "densify",
    "from_plain_dict",
    "non_tensor",
    "to_plain_dict",
]
