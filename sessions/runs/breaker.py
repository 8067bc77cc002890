"""The circuit breaker: when a run's failures mean *stop* (docs/failures.md "The circuit breaker").

A run whose sandbox service or inference server is down keeps failing: every session ends
`sandbox_error` or `connection_error`, its placeholders are zeros, and a training loop trains on
them. The breaker watches the run's sessions as they end, in log order, and trips on either rule:

* **consecutive**: `consecutive` counted failures with no success between them;
* **share**: counted failures are at least `max_share` of the last `window` sessions to end.

A failure counts when its origin is one of `origins` (default: `infra`, the failures that say a
dependency is down; a policy failure is the model's own zero) or its reason is one of `reasons`.
A cancellation is neither a failure nor a success: it is skipped; so is a session the ledger
failed as `orphaned` (left open by an earlier launch, failed when the next one starts): it says
how the last launch ended, not whether a dependency is down now. A trip is recorded as
`BreakerTripped` in the run's stream; the run stays halted until its next launch
(`RunLaunched`, a resume), which starts the fold afresh.

The fold is a pure function of the run's outcomes in log order, so a replay of the log trips at
the same position (`trips`), and `audit` holds each recorded `BreakerTripped` to it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sessions import events as ev
from sessions.errors import ConfigError
from sessions.vocabulary import INFRA, ORIGINS, ORPHANED

__all__ = ["BreakerFold", "CircuitBreaker", "Outcome", "describe", "trips"]

#: outcome kinds the fold reads
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
#: how many of the last errors, by reason, a trip keeps
_LAST_ERRORS = 3


@dataclass(frozen=True, slots=True)
class CircuitBreaker:
    """When a run halts (module docstring). The defaults, and why:

    * `consecutive=25`: prime-rl's default is 10 consecutive errored rollouts; the ledger counts
      sessions after their retries (`RetryPolicy`), so each counted failure already failed every
      attempt, and 25 in a row with no success between them is a dependency that is down, not a
      flaky one. At thousands of sessions a step, it costs under 1 % of a step's rollouts.
    * `window=200, max_share=0.8`: a dependency that answers one call in five: 4 of 5 sessions
      failing over the last 200 that ended. A healthy agentic run fails 1-20 % of its
      sessions; 80 % is not a run to train on.
    * `origins=("infra",)`: the failures that say the run's own machinery is broken; a policy
      failure (a wrong tool call, a malformed answer) is what RL is there to train away.
    """

    consecutive: int | None = 25
    window: int | None = 200
    max_share: float = 0.8
    origins: tuple[str, ...] = (INFRA,)
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("consecutive", "window"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"CircuitBreaker.{name} must be None (rule off) or an integer >= 1, got {value!r:.60}",
                    argument=name,
                )
        if isinstance(self.max_share, bool) or not (
            isinstance(self.max_share, (int, float)) and 0.0 < self.max_share <= 1.0
        ):
            raise ConfigError(
                f"CircuitBreaker.max_share must be a share in (0, 1], got {self.max_share!r:.60}",
                argument="max_share",
            )
        for name in ("origins", "reasons"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(
                value, (tuple, list, set, frozenset)
            ):
                raise ConfigError(
                    f"CircuitBreaker.{name} must be a tuple of names, got {value!r:.60}",
                    argument=name,
                )
        origins, reasons = tuple(self.origins), tuple(self.reasons)
        unknown = sorted(set(origins) - set(ORIGINS))
        if unknown:
            raise ConfigError(
                f"CircuitBreaker.origins: unknown origin(s) {unknown}; origins are {sorted(ORIGINS)}",
                argument="origins",
            )
        if not all(isinstance(r, str) and r for r in reasons):
            raise ConfigError(
                "CircuitBreaker.reasons must be failure reasons (non-empty strings)",
                argument="reasons",
            )
        if not origins and not reasons:
            raise ConfigError(
                "CircuitBreaker counts no failure (no origins, no reasons); pass "
                "circuit_breaker=None to turn the breaker off",
                argument="origins",
            )
        object.__setattr__(self, "origins", tuple(sorted(set(origins))))
        object.__setattr__(self, "reasons", tuple(sorted(set(reasons))))

    def counts(self, origin: str | None, reason: str | None) -> bool:
        """Whether a failure of this origin and reason counts towards a trip."""
        return origin in self.origins or reason in self.reasons

    def as_config(self) -> dict[str, Any]:
        """What the run's configuration records (`RunConfigured.config["breaker"]`)."""
        return {
            "consecutive": self.consecutive,
            "window": self.window,
            "max_share": float(self.max_share),
            "origins": list(self.origins),
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> CircuitBreaker | None:
        """The breaker a run's recorded configuration names (None: the run has none)."""
        if not config:
            return None
        return cls(
            consecutive=config.get("consecutive"),
            window=config.get("window"),
            max_share=config.get("max_share", 0.8),
            origins=tuple(config.get("origins", ())),
            reasons=tuple(config.get("reasons", ())),
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """One session's end, as the fold reads it (from its terminal event)."""

    position: int
    kind: str  # SUCCEEDED, FAILED or CANCELLED
    session_id: str = ""
    reason: str | None = None
    origin: str | None = None
    message: str = ""


def describe(tripped: ev.BreakerTripped) -> str:
    """Why the breaker tripped, in a line: the rule as recorded, the counts it saw, the counted
    failures by reason and the last error of each."""
    breaker = CircuitBreaker.from_config(tripped.breaker) or CircuitBreaker()
    if tripped.rule == "consecutive":
        why = f"{tripped.consecutive} counted failures in a row (consecutive={breaker.consecutive})"
    else:
        why = (
            f"{tripped.window_failures} of the last {tripped.window_sessions} sessions failed "
            f"(max_share={breaker.max_share:g} of window={breaker.window})"
        )
    reasons = ", ".join(f"{reason} ×{n}" for reason, n in sorted(tripped.by_reason.items()))
    last = "; ".join(
        f"last {reason}: {messages[-1]}"
        for reason, messages in sorted(tripped.last_errors.items())
        if messages
    )
    return f"{why}; failures by reason: {reasons}" + (f" ({last})" if last else "")


class BreakerFold:
    """The breaker's state over a run's outcomes in log order; `observe` returns the
    `BreakerTripped` to record at the outcome that trips it, then nothing until `relaunch`."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        self.breaker = breaker
        self.relaunch()

    def relaunch(self) -> None:
        """A new launch: the run runs again, its count starts afresh."""
        self.halted = False
        self.consecutive = 0
        #: the last `window` ends: the reason of each counted failure, None for any other end
        self._window: deque[str | None] = deque(maxlen=self.breaker.window or 1)
        #: the counted failures since the last success: their reasons, the last errors of each
        self._streak: dict[str, int] = {}
        self._last: dict[str, deque[str]] = {}

    def observe(self, outcome: Outcome) -> ev.BreakerTripped | None:
        if self.halted or outcome.kind == CANCELLED or outcome.reason == ORPHANED:
            return None
        counted = outcome.kind == FAILED and self.breaker.counts(outcome.origin, outcome.reason)
        reason = (outcome.reason or "unknown") if counted else None
        if outcome.kind == SUCCEEDED:
            self.consecutive, self._streak = 0, {}
        elif reason is not None:
            self.consecutive += 1
            self._streak[reason] = self._streak.get(reason, 0) + 1
            last = self._last.setdefault(reason, deque(maxlen=_LAST_ERRORS))
            last.append(f"{outcome.session_id}: {outcome.message}"[:300])
        # else: an uncounted failure (a policy failure) breaks no streak and extends none
        if self.breaker.window is not None:
            self._window.append(reason)
        failures = [r for r in self._window if r is not None]
        if self.breaker.consecutive is not None and self.consecutive >= self.breaker.consecutive:
            rule, by_reason = "consecutive", dict(self._streak)
        elif (
            self.breaker.window is not None
            and len(self._window) == self.breaker.window
            and len(failures) >= self.breaker.max_share * self.breaker.window
        ):
            rule, by_reason = "share", dict(Counter(failures))
        else:
            return None
        self.halted = True
        return ev.BreakerTripped(
            rule=rule,
            tripped_at=outcome.position,
            consecutive=self.consecutive,
            window_failures=len(failures),
            window_sessions=len(self._window),
            by_reason=by_reason,
            last_errors={r: list(self._last[r]) for r in sorted(by_reason) if r in self._last},
            breaker=self.breaker.as_config(),
        )


def trips(breaker: CircuitBreaker, outcomes: Iterable[Outcome | str]) -> list[ev.BreakerTripped]:
    """Every trip of a run's fold: `outcomes` in log order, the string `"launch"` where a
    `RunLaunched` stands (it re-arms a halted breaker)."""
    fold = BreakerFold(breaker)
    found: list[ev.BreakerTripped] = []
    for item in outcomes:
        if isinstance(item, str):
            fold.relaunch()
            continue
        trip = fold.observe(item)
        if trip is not None:
            found.append(trip)
    return found
