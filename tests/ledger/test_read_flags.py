"""A read's on/off option refuses what is not one: an array or a list given by mistake would
otherwise pass or fail on its truth value (numpy's raises ValueError, not the ledger's error)."""

from __future__ import annotations

import numpy as np
import pytest

from sessions import Ledger
from sessions.errors import InvalidArgumentType


@pytest.mark.parametrize("bad", [np.array([1.5, 2.5]), [True], "yes", 2, None])
async def test_metrics_refuses_a_project_option_that_is_not_a_bool(
    db_url: str, bad: object
) -> None:
    async with Ledger.open(db_url) as ledger:
        with pytest.raises(InvalidArgumentType, match="project must be True or False"):
            await ledger.metrics(project=bad)  # type: ignore[arg-type]
        assert await ledger.metrics(project=np.bool_(False)) == []
