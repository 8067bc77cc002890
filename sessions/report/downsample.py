"""Bucketing a long run's steps into at most `MAX_POINTS` points per series.

A run of 10^5 steps must not become 10^5 points per line (slow to draw, unreadable, a huge
PNG). Consecutive steps are grouped into equal-count buckets of `ceil(n / max_points)` steps;
each bucket is drawn at the mean of its steps, with the mean of its values -- or their maximum
for a series that is itself a maximum (`response_length/max`). Runs of at most `max_points`
steps are drawn as they are. Absent values (NaN: a mean with no denominator at that step) are
left out of a bucket's reduction; a bucket with no value stays NaN, a gap in the line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sessions.errors import InvalidArgument

__all__ = ["MAX_POINTS", "Buckets", "bucket_steps", "reduce"]

MAX_POINTS = 200


@dataclass(frozen=True)
class Buckets:
    """Consecutive index ranges over a sorted list of steps, and where each is drawn."""

    x: list[float]  # the mean step of each bucket
    bounds: list[tuple[int, int]]  # [start, stop) indices into the steps
    size: int  # steps per bucket (the last may hold fewer); 1 when not downsampled

    @property
    def downsampled(self) -> bool:
        return self.size > 1


def bucket_steps(steps: Sequence[int], max_points: int = MAX_POINTS) -> Buckets:
    """Buckets of `ceil(len(steps) / max_points)` consecutive steps (so at most `max_points`)."""
    if max_points < 1:
        raise InvalidArgument(f"max_points must be >= 1, got {max_points}")
    size = max(1, math.ceil(len(steps) / max_points))
    bounds = [(start, min(start + size, len(steps))) for start in range(0, len(steps), size)]
    x = [sum(steps[a:b]) / (b - a) for a, b in bounds]
    return Buckets(x, bounds, size)


def reduce(values: Sequence[float], buckets: Buckets, how: str = "mean") -> list[float]:
    """One value per bucket: the mean (or `max`) of its non-NaN values; NaN when it has none."""
    if how not in ("mean", "max"):
        raise InvalidArgument(f"how must be 'mean' or 'max', got {how!r}")
    out = []
    for a, b in buckets.bounds:
        present = [v for v in values[a:b] if not math.isnan(v)]
        if not present:
            out.append(math.nan)
        else:
            out.append(max(present) if how == "max" else sum(present) / len(present))
    return out
