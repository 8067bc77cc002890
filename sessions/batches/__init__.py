"""Projected rows -> verl-convention torch batches (docs/design.md §6).

Two layouts of the same columns (``columns``):

* padded (``build_padded``, ``padded``): what verl's trainer consumes. Prompts are left-padded,
  responses right-padded, ``input_ids = cat(prompts, responses)``, the reward sits on the last
  attended response token of ``rm_scores``. As wide as the longest row, or exactly
  ``prompt_width`` x ``response_width`` (verl pads every step to its ``max_prompt_length`` /
  ``max_response_length``, so two steps' batches ``torch.cat``); ``pad_to_widths`` re-pads a
  built batch.
* jagged (``build_jagged``, ``jagged``): unpadded ``torch.jagged`` nested tensors, what row
  stores such as TransferQueue hold, each built with its ``min_seqlen``/``max_seqlen`` (so
  ``to_padded_tensor`` is as wide as the longest row). ``densify`` turns it into the padded
  layout.

Rows are validated, and truncated if asked, once (``collect``), into per-row arrays the padded
writer copies straight into place. The jagged builder concatenates each column once (the *flat*
form, ``flat``); ``densify``, ``concat_padded`` and ``pad_to_widths`` (``convert``) reduce any
batch to flat and split it back into per-row views for the same padded writer.
``to_plain_dict`` / ``from_plain_dict`` (``plain``) export a batch as plain tensors and lists.

The columns a verl 0.9.1 step reads are all there, in every layout: float32 ``prompt_length`` /
``response_length`` (``compute_data_metrics`` takes ``torch.mean`` of them); int64 ``num_turns``
(the V1 trainer reads it) and the same numbers as the non-tensor ``__num_turns__`` (what
``compute_data_metrics`` reports as ``num_turns/*``); ``multi_modal_inputs``, a ``{}`` per row
(``RayPPOTrainer.fit`` reads it unconditionally). ``num_turns`` is ``meta["num_turns"]`` (the
projected queue rows carry it); without one, 0 for a placeholder and ``UNKNOWN_TURNS`` (-1)
otherwise, the TransferQueue adapter's "unknown".

Non-tensor columns (``NON_TENSOR_COLUMNS``) are stored as ``tensordict.NonTensorStack`` of
length B. ``batch["uid"]`` returns a ``list`` subclass; ``non_tensor(batch, "uid")`` returns a
plain ``list`` and also copes with a column set through ``set_non_tensor``. A stack is one
``NonTensorData`` object per row, which cost more than the tensor columns, so the builders set
a ``ColumnStack`` (a ``NonTensorStack`` holding the column as one list) that makes those
objects only when tensordict or verl asks for them; ``non_tensor`` and ``to_data_proto`` read
the list (``non_tensor_stacks``).

Row operations keep every column aligned, non-tensor ones included. ``select_rows``,
``concat_batches`` and ``split_batch`` (``indexing``) work on both layouts under every
supported tensordict; plain ``batch[index]``, ``torch.cat`` and ``batch.split`` do too with
tensordict 0.15.3 (but its ``split`` makes a chunk of 0 rows without proper non-tensor
columns), and on padded batches with verl's pin 0.10.0 except where the result or the input
has no rows (``tensordict_compat`` records what 0.10.0 lacks).

Decisions recorded here (the contract is silent on them):

* ``rollout_log_probs`` exists iff at least one row carries logprobs; rows without logprobs get
  zeros in it (they are then indistinguishable from logprob 0.0 -- check ``is_placeholder`` or
  keep logprobs on all rows if that matters). So an empty step (no rows) has no
  ``rollout_log_probs`` by default: it cannot tell whether its run records logprobs.
  ``build_padded(..., logprobs=True)`` says it does: the column is there on every batch, ``[0, R]``
  zeros for an empty one, and the empty step ``torch.cat``-s (and, through ``to_data_proto``,
  ``DataProto.concat``-s) with its run's other steps; ``logprobs=False`` leaves the column out
  whatever the rows carry. ``concat_padded`` needs neither (it fills missing logprobs).
* A row with an empty response (length 0) keeps its reward out of ``rm_scores`` (there is no
  attended response token to put it on). verl reads such a row as "aborted" and excludes it from
  score metrics anyway; the 1+1-token placeholder exists precisely to avoid this case.
* A placeholder row must have an all-zero ``response_mask``; otherwise ``ValueError``.
* A row longer than 2**24 tokens (``MAX_EXACT_LENGTH``, float32's exact integers) is refused
  rather than given a rounded length.
* A fixed width is also a length limit: a longer row raises ``BatchTooLongError`` naming the
  row and the option (``prompt_width``, ``max_prompt_length``, ...) unless ``truncate=True``.
  Re-laying out a built batch with truncation adds the cut tokens' ``rm_scores`` onto the new
  last token, so each row's score is unchanged.
* An empty ``rows`` sequence gives ``batch_size=[0]`` with every column present and width 0 (or
  the given widths). ``torch.cat`` needs equal widths for padded batches, so use
  ``concat_padded`` (or ``pad_to_widths`` first) to concatenate padded batches of different
  widths (including empty ones); jagged batches with the same keys concatenate with
  ``concat_batches`` (``concat_padded`` also takes them, with or without ``rollout_log_probs``).
* ``meta`` keys outside ``META_COLUMNS`` (and ``num_turns``) are ignored; numpy scalars are
  turned into Python scalars so the columns stay ``torch.load(weights_only=True)``-safe.
"""

from __future__ import annotations

from sessions.batches.collect import BatchRow, BatchTooLongError
from sessions.batches.columns import (
    COLUMN_DTYPES,
    LAYOUT_COLUMNS,
    MAX_EXACT_LENGTH,
    META_COLUMNS,
    NON_TENSOR_COLUMNS,
    PROMPT_COLUMNS,
    RESPONSE_COLUMNS,
    ROW_COLUMNS,
    SEQUENCE_COLUMNS,
    TOKEN_COLUMNS,
    UNKNOWN_TURNS,
    VERL_NON_TENSOR_COLUMNS,
)
from sessions.batches.convert import concat_padded, densify, pad_to_widths
from sessions.batches.indexing import concat_batches, select_rows, split_batch
from sessions.batches.jagged import build_jagged
from sessions.batches.non_tensor_stacks import non_tensor
from sessions.batches.padded import build_padded
from sessions.batches.plain import from_plain_dict, to_plain_dict

__all__ = [
    "BatchRow",
    "BatchTooLongError",
    "COLUMN_DTYPES",
    "LAYOUT_COLUMNS",
    "MAX_EXACT_LENGTH",
    "META_COLUMNS",
    "NON_TENSOR_COLUMNS",
    "PROMPT_COLUMNS",
    "RESPONSE_COLUMNS",
    "ROW_COLUMNS",
    "SEQUENCE_COLUMNS",
    "TOKEN_COLUMNS",
    "UNKNOWN_TURNS",
    "VERL_NON_TENSOR_COLUMNS",
    "build_jagged",
    "build_padded",
    "concat_batches",
    "concat_padded",
    "densify",
    "from_plain_dict",
    "non_tensor",
    "pad_to_widths",
    "select_rows",
    "split_batch",
    "to_plain_dict",
]
