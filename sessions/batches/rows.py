"""Queue rows -> `BatchRow`s: the token arrays behind each row, read from the event payloads.

A queue row stores no tokens of its own: it points at the event that holds them (the
trajectory's `TrajectoryRecorded`, or the failed session's `PlaceholderEmitted`). So the queue
table costs a few dozen bytes per row, and the log stays the one copy of every token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from sessions import events as ev
from sessions import tokens
from sessions.batches import BatchRow
from sessions.batches.columns import ROW_META
from sessions.errors import ProjectionError
from sessions.gc_pause import gc_paused
from store import read_models as rm


def _placeholder_arrays(
    token_id: int, prompt_len: int = 1, response_len: int = 1
) -> tokens.TokenArrays:
    """The placeholder's tokens: `prompt_len` + `response_len` copies of its token (default 1 + 1,
    as the policy recorded them), every one attended, the response's mask all 0."""
    prompt = np.full(prompt_len, token_id, dtype="<i4")
    response = np.full(response_len, token_id, dtype="<i4")
    return tokens.TokenArrays(prompt, response, np.zeros(response_len, dtype=np.uint8), None)


def _placeholder_token(type_: str, data: Any) -> int:
    """The token a placeholder row repeats: its PlaceholderEmitted's `token_id`, or 0 for the
    placeholder of a session the projector quarantined (its source is the unprojectable event)."""
    if type_ == "PlaceholderEmitted" and isinstance(data, dict):
        token = data.get("token_id")
        if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 2**31:
            return token
    return 0


def materialise(
    queue_rows: Sequence[Mapping[str, Any]], sources: Mapping[int, rm.SourceEvent]
) -> list[BatchRow]:
    """Build one BatchRow per queue row of kind 'row', in the given order.

    With the cyclic collector paused (`sessions.gc_pause`): the rows and their meta dicts are
    long-lived and acyclic, and a full collection that their allocations set off mid-loop scans
    every object of a trainer's process (a few hundred ms at a 4,096-row step) for nothing.
    """
    with gc_paused():
        return _materialise(queue_rows, sources)


def _materialise(
    queue_rows: Sequence[Mapping[str, Any]], sources: Mapping[int, rm.SourceEvent]
) -> list[BatchRow]:
    out: list[BatchRow] = []
    append = out.append
    for row in queue_rows:
        if row["kind"] != "row":
            continue
        source = sources.get(row["source_position"])
        if source is None:
            raise ProjectionError(
                f"queue row {row['key']!r} points at event position {row['source_position']}, which is missing; "
                "the database was altered outside rollout-ledger — run `rollout-ledger audit`"
            )
        arrays = _arrays(row, source)
        append(
            BatchRow(
                arrays.prompt_ids,
                arrays.response_ids,
                arrays.response_mask,
                arrays.logprobs,
                float(row["reward"] or 0.0),
                bool(row["is_placeholder"]),
                _meta(row),
            )
        )
    return out


_TRAJECTORY_SCHEMA = ev.TrajectoryRecorded.SCHEMA_VERSION
_META_NAMES = tuple(name for name in ROW_META if name != "is_partial")
_meta_values = itemgetter(*_META_NAMES)


def _meta(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row's meta columns (`is_partial` as a bool); read with one itemgetter, as a queue row
    read back has every column (a hand-made one may lack some: None, as before)."""
    try:
        meta = dict(zip(_META_NAMES, _meta_values(row)))
    except KeyError:
        meta = {name: row.get(name) for name in _META_NAMES}
    meta["is_partial"] = bool(row.get("is_partial"))
    return meta


def _arrays(row: Mapping[str, Any], source: rm.SourceEvent) -> tokens.TokenArrays:
    """The row's tokens: the placeholder's, or views over its trajectory's payload."""
    type_, schema_version, data, payload = source
    if row["is_placeholder"]:
        return _placeholder_arrays(
            _placeholder_token(type_, data),
            int(row.get("prompt_len") or 1),
            int(row.get("response_len") or 1),
        )
    if schema_version != _TRAJECTORY_SCHEMA or type_ != "TrajectoryRecorded":
        data = ev.upcast(type_, schema_version, data)
    return tokens.decode(
        payload or b"",
        int(data["prompt_len"]),
        int(data["response_len"]),
        bool(data["has_logprobs"]),
    )
