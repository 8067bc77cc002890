"""One difference an audit found: where it is, and what replay expected against what is stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Divergence",
]


@dataclass(frozen=True)
class Divergence:
    table: str
    key: str
    field: str
    expected: Any
    found: Any
    session_id: str | None = None
    position: int | None = None

    def __str__(self) -> str:
        where = (
            f"session {self.session_id!r} "
            if self.session_id and self.session_id not in self.key
            else ""
        )
        at = f"at event position {self.position} " if self.position is not None else ""
        return f"{self.table} {self.key}: {where}{at}field {self.field!r}: expected {self.expected!r}, found {self.found!r}"
