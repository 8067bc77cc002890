"""Reading stored JSON columns: `json.loads` with an error that says what is wrong and what to do.

Every engine `create_engine` makes on SQLite decodes JSON columns with `load_json`, and the readers
that take `data` as text (the projection decoder, the audit) call it themselves.
"""

from __future__ import annotations

import json

from store.errors import StoreError

__all__ = ["StoredJSONError", "load_json"]


class StoredJSONError(StoreError, ValueError):
    """A JSON column holds text that is not JSON: the database was altered outside the library.

    SQLite stores JSON as text, so a hand edit can leave it malformed (PostgreSQL's JSONB refuses
    such a write). Raised on read instead of a bare `JSONDecodeError`; a `ValueError`, so replay
    and audit treat it as a damaged log.
    """


def load_json(text: str | bytes) -> object:
    """`json.loads` for stored JSON columns, with an error that says what is wrong and what to do."""
    try:
        return json.loads(text)
    except ValueError as error:
        excerpt = text[:80] if isinstance(text, (str, bytes)) else text
        where = f" at char {error.pos}" if isinstance(error, json.JSONDecodeError) else ""
        raise StoredJSONError(
            f"stored JSON is malformed ({getattr(error, 'msg', error)}{where}): {excerpt!r}; the database was "
            "altered outside rollout-ledger — run `rollout-ledger audit` and restore the row from a backup"
        ) from None
