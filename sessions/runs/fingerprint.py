"""A run's configuration fingerprint: recorded once, checked on every later writer, so a resumed
run cannot silently change what its numbers mean.

The configuration is the ledger's failure semantics (placeholder, metric and retry policies,
trajectory selection, `min_valid`) plus a dict the user supplies (their trainer config). Its
digest is the SHA-256 of its canonical JSON. The first ledger to write to a run appends a
`RunConfigured` event to the run's own stream (`@run:<run>`); a ledger opened later on that run
with another digest is refused with the keys that changed, unless it resumes explicitly with
`resume="new-config"`, which appends the new configuration and the change.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from sessions import events as ev
from sessions import storable
from sessions.errors import InvalidInput, LedgerError
from store import ConcurrencyError, EventStore

__all__ = [
    "NEW_CONFIG",
    "RunConfigMismatch",
    "canonical",
    "changes",
    "digest",
    "ensure_recorded",
    "run_stream",
]

#: `Ledger.open(resume=...)`: accept, and record, a configuration other than the run's.
NEW_CONFIG = "new-config"
#: How many changed keys an error lists before it says "and N more".
_SHOWN = 8


class RunConfigMismatch(LedgerError):
    """The run was recorded with another configuration; nothing was written."""

    def __init__(self, run: str, changed: list[str]) -> None:
        shown = "; ".join(changed[:_SHOWN]) + (
            f"; and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
        )
        super().__init__(
            f"run {run!r} was recorded with another configuration ({shown}); resuming it would mix two "
            f"meanings of its metrics — open it with the recorded configuration, use a new run name, or pass "
            f"resume={NEW_CONFIG!r} to record the change and go on"
        )
        self.run = run
        self.changed = changed


def run_envelope(event: ev.Event, run: str, *, version: int) -> Any:
    """`event` wrapped for the run's own stream (`run_stream`): no group, partition or step; the
    run's configuration and its prunes (`sessions.runs.retention`) are written this way."""
    return ev.envelope(
        event,
        session_id=run_stream(run),
        version=version,
        run=run,
        uid="",
        partition="",
        global_step=None,
    )


def run_stream(run: str) -> str:
    """The id of the run's configuration stream: `@run:<run>`, or `@run:#<sha-256 of run>` for a
    run name too long to fit the 128-character stream id beside the prefix."""
    stream = f"{ev.RUN_STREAM_PREFIX}{run}"
    if len(stream) <= 128:
        return stream
    return f"{ev.RUN_STREAM_PREFIX}#{hashlib.sha256(run.encode('utf-8', 'backslashreplace')).hexdigest()}"


def canonical(config: Mapping[str, Any], where: str = "config") -> dict[str, Any]:
    """`config` as plain JSON (sorted keys, tuples as lists); a value JSON cannot hold is an error."""

    def plain(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidInput(None, path, f"must be a finite number, got {value!r}")
            return float(value)
        if isinstance(value, Mapping):
            return {
                str(k): plain(v, f"{path}.{k}")
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            }
        if isinstance(value, (list, tuple)):
            return [plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if hasattr(value, "item") and callable(value.item):  # a numpy scalar
            return plain(value.item(), path)
        raise InvalidInput(
            None,
            path,
            f"must be JSON-like (dict, list, str, number, bool, None), got {type(value).__name__}",
        )

    return plain(dict(config), where)  # type: ignore[no-any-return]


def digest(config: Mapping[str, Any]) -> str:
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else key, out)
    else:
        out[prefix] = value


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The keys that differ, each as `key: old -> new` (dotted paths; `<unset>` when absent)."""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    _flatten(dict(old), "", before)
    _flatten(dict(new), "", after)
    unset = "<unset>"
    return [
        f"{key}: {json.dumps(before.get(key, unset))} -> {json.dumps(after.get(key, unset))}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key, unset) != after.get(key, unset)
    ]


async def ensure_recorded(
    store: EventStore, run: str, config: Mapping[str, Any], resume: str | None
) -> None:
    """Record `config` for `run` if the run has none, accept it if it is the recorded one, record
    the change if `resume == NEW_CONFIG`, else raise `RunConfigMismatch`. A writer that races
    another to the first record re-reads and checks against the winner's."""
    stream = run_stream(run)
    wanted = digest(config)
    for _ in range(3):
        stored = await store.read_stream(stream)
        recorded = [ev.decode(s).event for s in stored]
        # The last configuration: a prune (PayloadsPruned) may follow it in the run's stream.
        configs = [e for e in recorded if isinstance(e, ev.RunConfigured)]
        current = configs[-1] if configs else None
        if isinstance(current, ev.RunConfigured) and current.digest == wanted:
            return
        change = None
        if isinstance(current, ev.RunConfigured):
            changed = changes(current.config, config)
            if resume != NEW_CONFIG:
                raise RunConfigMismatch(run, changed)
            change = {"previous": current.digest, "changed": changed}
        event = storable.clean_event(
            stream, ev.RunConfigured(digest=wanted, config=dict(config), change=change)
        )
        envelope = run_envelope(event, run, version=len(stored) + 1)
        try:
            await store.submit(stream, len(stored), [envelope])
            return
        except ConcurrencyError:
            continue  # another writer recorded first: check against what it recorded
    raise LedgerError(
        f"run {run!r}: could not record its configuration (writers kept racing); try again"
    )
