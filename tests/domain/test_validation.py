"""Token-id range check: the one-pass unsigned view must agree with the plain min/max test."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sessions.errors import InvalidInput
from sessions.validation import TOKEN_LIMIT, token_array

INT_DTYPES = st.sampled_from(["<i4", "<i8", ">i8", "<i2", "<u4", "<u8", "|u1"])


@given(hnp.arrays(INT_DTYPES, st.integers(1, 64)))
def test_token_ids_are_accepted_exactly_when_every_id_is_in_range(array: np.ndarray) -> None:
    in_range = int(array.min()) >= 0 and int(array.max()) < TOKEN_LIMIT
    if in_range:
        out = token_array("s", "prompt_ids", array)
        assert out.dtype == np.dtype("<i4") and out.tolist() == array.tolist()
    else:
        with pytest.raises(InvalidInput, match="outside"):
            token_array("s", "prompt_ids", array)
