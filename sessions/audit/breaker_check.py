"""The audit's check of the circuit breaker: each recorded `BreakerTripped` is where a fold of
the run's session ends (`sessions.runs.breaker`), under the rule the run's configuration
recorded, trips. A trip the fold finds with no record after it is no divergence: the run ended,
or no ledger looked, before anyone recorded it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sessions import events as ev
from sessions.audit.divergence import Divergence
from sessions.runs.breaker import BreakerFold, CircuitBreaker
from sessions.runs.halts import outcome_of

__all__ = ["BreakerCheck"]


class BreakerCheck:
    """Fed every event of the log in position order (`see`); yields a divergence for a recorded
    trip the fold does not make at that position."""

    TYPES = frozenset({"RunConfigured", "RunLaunched", "BreakerTripped", *ev.TERMINAL_EVENTS})

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._folds: dict[str, BreakerFold] = {}
        #: each run's trips the fold made and no record has answered yet: position -> rule
        self._made: dict[str, dict[int, str]] = {}

    def see(self, position: int, sid: str, type_: str, data: Any, run: str) -> Iterable[Any]:
        if not isinstance(data, dict):
            return
        if type_ == "RunConfigured":
            config = data.get("config") if isinstance(data.get("config"), dict) else {}
            try:
                breaker = CircuitBreaker.from_config(config.get("breaker"))
            except Exception:  # noqa: BLE001 - a damaged configuration: no fold to hold trips to
                breaker = None
            if breaker is None:
                self._folds.pop(run, None)
            else:
                self._folds[run] = BreakerFold(breaker)
            return
        fold = self._folds.get(run)
        if type_ == "RunLaunched":
            if fold is not None:
                fold.relaunch()
            self._made.pop(run, None)
        elif type_ == "BreakerTripped":
            tripped_at = data.get("tripped_at")
            made = self._made.get(run, {})
            if made.pop(tripped_at, None) != data.get("rule"):
                yield (
                    position,
                    self._rank,
                    Divergence(
                        "events",
                        f"run {run}",
                        "tripped_at",
                        f"a trip of the run's breaker ({sorted(made) or 'none'} by its fold)",
                        f"{data.get('rule')} at position {tripped_at}",
                        sid,
                        position,
                    ),
                )
        elif fold is not None and not sid.startswith(ev.RUN_STREAM_PREFIX):
            trip = fold.observe(outcome_of(position, sid, type_, data))
            if trip is not None:
                self._made.setdefault(run, {})[trip.tripped_at] = trip.rule
