"""The section 6 columns of a batch, by name and dtype: declared here once, read everywhere else.

Builders, converters and the TransferQueue adapter all take their column lists from this module,
so a column added or retyped here is added or retyped for every layout at once.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

__all__ = [
    "COLUMN_DTYPES",
    "LAYOUT_COLUMNS",
    "MAX_EXACT_LENGTH",
    "NUMPY_DTYPES",
    "NON_TENSOR_COLUMNS",
    "PROMPT_COLUMNS",
    "RESPONSE_COLUMNS",
    "ROW_COLUMNS",
    "SEQUENCE_COLUMNS",
    "TOKEN_COLUMNS",
]

NON_TENSOR_COLUMNS: tuple[str, ...] = (
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
)

#: token-level columns, by which side of the sequence they belong to
PROMPT_COLUMNS: tuple[str, ...] = ("prompts",)
RESPONSE_COLUMNS: tuple[str, ...] = ("responses", "response_mask", "rm_scores", "rollout_log_probs")
SEQUENCE_COLUMNS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")
TOKEN_COLUMNS: tuple[str, ...] = PROMPT_COLUMNS + RESPONSE_COLUMNS + SEQUENCE_COLUMNS
#: one value per row
ROW_COLUMNS: tuple[str, ...] = ("prompt_length", "response_length", "is_placeholder")

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
}

#: the longest row a float32 length column holds exactly (2**24 tokens); longer rows are refused
MAX_EXACT_LENGTH: int = 2**24

#: the same dtypes for the numpy arrays rows are gathered into (derived, not declared again)
NUMPY_DTYPES: Mapping[str, np.dtype] = {
    name: torch.empty(0, dtype=dtype).numpy().dtype for name, dtype in COLUMN_DTYPES.items()
}
