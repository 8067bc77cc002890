"""Argument types for every verb: each number has bounds and each name must be non-empty.

Every option that takes a value is declared with one of these types (or `choices`), and
`tests/cli/test_arguments.py` walks the whole parser to hold that: a new flag without bounds is a
failing test, not a `MemoryError` or a draw that runs for minutes.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Bounded", "Text", "integer", "number", "rate", "step", "text"]


@dataclass(frozen=True)
class Bounded:
    """An int or float type for argparse with inclusive bounds, named in its error message."""

    kind: Callable[[str], Any]
    low: float
    high: float
    what: str = ""

    def __call__(self, raw: str) -> Any:
        try:
            value = self.kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{raw!r} is not {'an integer' if self.kind is int else 'a number'}"
            ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{raw} is not a finite number")
        if not self.low <= value <= self.high:
            what = f" ({self.what})" if self.what else ""
            raise argparse.ArgumentTypeError(
                f"{raw} is out of range: pass {_show(self.low)} to {_show(self.high)}{what}"
            )
        return value

    @property
    def __name__(self) -> str:  # argparse names the type in "invalid <name> value"
        return self.kind.__name__


@dataclass(frozen=True)
class Text:
    """A name or path for argparse: refused when empty or only white space."""

    what: str = "a name"

    def __call__(self, raw: str) -> str:
        if not raw.strip():
            raise argparse.ArgumentTypeError(f"is empty: pass {self.what}")
        return raw

    @property
    def __name__(self) -> str:
        return "text"


def _show(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def integer(low: int, high: int, what: str = "") -> Bounded:
    return Bounded(int, low, high, what)


def number(low: float, high: float, what: str = "") -> Bounded:
    return Bounded(float, low, high, what)


def text(what: str = "a name") -> Text:
    return Text(what)


#: A probability of the demo's simulated failures.
rate = number(0.0, 1.0, "a rate")

#: Global steps: what the events table stores (docs/design.md §2), or 'none' for ad-hoc sessions.
_MAX_STEP = 2**31 - 1


def step(raw: str) -> int | None:
    """A global step: an integer in [0, 2^31 - 1], or 'none' / 'null' / '-' for no step."""
    if raw.strip().lower() in ("none", "null", "-"):
        return None
    return integer(0, _MAX_STEP, "a step, or 'none'")(raw)


step.bounds = (0, _MAX_STEP)  # type: ignore[attr-defined]
