"""The section 6 columns of a batch, by name and dtype: declared here once, read everywhere else.

Builders, converters and the TransferQueue adapter all take their column lists from this module,
so a column added or retyped here is added or retyped for every layout at once.

Beside the table of docs/design.md §6, a batch carries the columns a verl 0.9.1 PPO step reads:
``num_turns`` (int64 [B], read by the V1 trainer), ``__num_turns__`` (the same numbers as a
non-tensor column: ``compute_data_metrics`` reports ``num_turns/*`` only when it is there) and
``multi_modal_inputs`` (one dict per row, ``{}`` for text-only rows: ``RayPPOTrainer.fit`` reads
it unconditionally).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

__all__ = [
    "COLUMN_DTYPES",
    "LAYOUT_COLUMNS",
    "MAX_EXACT_LENGTH",
    "META_COLUMNS",
    "META_DEFAULTS",
    "NUMPY_DTYPES",
    "NON_TENSOR_COLUMNS",
    "PROMPT_COLUMNS",
    "RESPONSE_COLUMNS",
    "ROW_COLUMNS",
    "ROW_META",
    "SEQUENCE_COLUMNS",
    "TOKEN_COLUMNS",
    "UNKNOWN_TURNS",
    "VERL_NON_TENSOR_COLUMNS",
]

#: non-tensor columns copied from each row's ``BatchRow.meta`` (None where it lacks one)
META_COLUMNS: tuple[str, ...] = (
    "run",
    "uid",
    "session_id",
    "session_index",
    "key",
    "partition",
    "global_step",
    "data_source",
    "failure_reason",
    "materialization_reason",
    # True on a failed session's trajectory sent with its own reward (placeholder policy keep_partial)
    "is_partial",
    # the lowest and highest weights version behind the response (verl's names; None unknown or
    # a placeholder: docs/design.md §15)
    "min_global_steps",
    "max_global_steps",
)

#: a queue row's columns that ``sessions.batches.rows`` copies into its ``BatchRow.meta``: the
#: META columns, and ``num_turns`` (a tensor column, which the builders read from the meta)
ROW_META: tuple[str, ...] = (*META_COLUMNS, "num_turns")

#: what a META column holds for a row whose meta lacks it (others: None)
META_DEFAULTS: Mapping[str, object] = {"is_partial": False}

#: non-tensor columns verl reads, derived from the row rather than copied from its meta:
#: ``__num_turns__`` is always ``num_turns`` again; ``multi_modal_inputs`` is ``{}`` per row
#: unless the batch being re-laid out already had one
VERL_NON_TENSOR_COLUMNS: tuple[str, ...] = ("__num_turns__", "multi_modal_inputs")

#: every non-tensor column a batch has, in the order they are set
NON_TENSOR_COLUMNS: tuple[str, ...] = META_COLUMNS + VERL_NON_TENSOR_COLUMNS

#: token-level columns, by which side of the sequence they belong to
PROMPT_COLUMNS: tuple[str, ...] = ("prompts",)
RESPONSE_COLUMNS: tuple[str, ...] = ("responses", "response_mask", "rm_scores", "rollout_log_probs")
SEQUENCE_COLUMNS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")
TOKEN_COLUMNS: tuple[str, ...] = PROMPT_COLUMNS + RESPONSE_COLUMNS + SEQUENCE_COLUMNS
#: one value per row
ROW_COLUMNS: tuple[str, ...] = ("prompt_length", "response_length", "is_placeholder", "num_turns")

#: the tensor columns the converters re-lay out (densify, concat_padded); any other is refused
LAYOUT_COLUMNS: frozenset[str] = frozenset(TOKEN_COLUMNS + ROW_COLUMNS)

#: the dtype of every tensor column, in both layouts
COLUMN_DTYPES: Mapping[str, torch.dtype] = {
    "prompts": torch.int64,
    "responses": torch.int64,
    "input_ids": torch.int64,
    "attention_mask": torch.int64,
    "position_ids": torch.int64,
    "response_mask": torch.int64,
    "rm_scores": torch.float32,
    "rollout_log_probs": torch.float32,
    # float, as verl V1 and its compute_data_metrics expect (torch.mean raises on int64)
    "prompt_length": torch.float32,
    "response_length": torch.float32,
    "is_placeholder": torch.bool,
    "num_turns": torch.int64,
}

#: ``num_turns`` of a row whose meta has none: a placeholder has 0 (docs/design.md §5), any other
#: row this marker (what the TransferQueue adapter has always written for "unknown")
UNKNOWN_TURNS: int = -1

#: the longest row a float32 length column holds exactly (2**24 tokens); longer rows are refused
MAX_EXACT_LENGTH: int = 2**24

#: the same dtypes for the numpy arrays rows are gathered into (derived, not declared again)
NUMPY_DTYPES: Mapping[str, np.dtype] = {
    name: torch.empty(0, dtype=dtype).numpy().dtype for name, dtype in COLUMN_DTYPES.items()
}
