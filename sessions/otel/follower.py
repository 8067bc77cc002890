"""Sessions sent to a trace receiver as they end, from a checkpoint (docs/otel.md, "The follower").

The follower reads the sessions that ended after its checkpoint and by the projector's (in the
order they ended, `store.otel_follower`), sends each page's spans, and only then moves its
checkpoint, in a transaction of its own. A restart reads the checkpoint and goes on after it, so
no settled session is skipped. A process killed after a page was sent and before its checkpoint
committed sends that page again on restart: the same spans with the same derived ids, which a
viewer keyed on span ids shows once. That is the one repeat possible, at most one page.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sessions.errors import ConfigError
from sessions.otel.export import DEFAULT_PAGE_SIZE, resource_for, send_spans, session_spans
from sessions.otel.spans import require_sdk
from store import otel_follower

__all__ = ["DEFAULT_FOLLOWER", "FollowedPage", "follow_otel"]

#: The checkpoint's name when none is given.
DEFAULT_FOLLOWER = "otel"


@dataclass(frozen=True)
class FollowedPage:
    """One page sent and checkpointed: its sessions and spans, the follower's new position, and
    its totals since it first ran (`sent`) and in this call (`spans_total`)."""

    sessions: int
    spans: int
    position: int
    sent: int
    spans_total: int


async def follow_otel(
    ledger: Any,
    exporter: Any,
    *,
    name: str = DEFAULT_FOLLOWER,
    run: str | None = None,
    project: str | None = None,
    resource: Mapping[str, str] | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    poll_s: float = 1.0,
    stop: asyncio.Event | None = None,
    until_caught_up: bool = False,
    on_page: Callable[[FollowedPage], None] | None = None,
) -> int:
    """Send every session that ends to `exporter`, page by page, from the checkpoint `name`;
    returns the sessions this call sent.

    Runs until `stop` is set, or with `until_caught_up` until no ended session is left past the
    checkpoint (the projector's, as of that read). `run` None follows every run of the database
    (each run's spans carry its own resource; `project` and `resource` as `resource_for`). `poll_s`: the wait when nothing new has ended.
    `on_page` is called after each page's checkpoint committed."""
    require_sdk()
    if not name:
        raise ConfigError("the follower's name must not be empty (it keys its checkpoint)")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ConfigError(f"page_size must be an integer >= 1, got {page_size!r}")
    if not poll_s > 0:
        raise ConfigError(f"poll_s must be > 0 seconds, got {poll_s!r}")
    engine, store = ledger.engine, ledger.store
    async with engine.connect() as conn:
        position, sent = await otel_follower.follower_state(conn, name)
    resources: dict[str, Any] = {}
    sent_now = spans_total = 0
    while stop is None or not stop.is_set():
        async with engine.connect() as conn:
            _, page = await otel_follower.settled_after(
                conn, after=position, run=run, limit=page_size
            )
        if not page:
            if until_caught_up:
                break
            if stop is None:
                await asyncio.sleep(poll_s)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), poll_s)
                except TimeoutError:
                    pass
            continue
        streams = await store.read_streams([row["session_id"] for row in page], with_payload=False)
        spans: list[Any] = []
        for row in page:
            made = resources.get(row["run"])
            if made is None:
                made = resources[row["run"]] = resource_for(row["run"], project, resource)
            spans.extend(session_spans(streams, [row], made))
        await send_spans(exporter, spans)
        moved_to = int(page[-1]["terminal_position"])
        async with engine.begin() as conn:
            await otel_follower.move_follower(
                conn, name, previous=position, position=moved_to, sent=len(page)
            )
        position = moved_to
        sent += len(page)
        sent_now += len(page)
        spans_total += len(spans)
        if on_page is not None:
            on_page(FollowedPage(len(page), len(spans), position, sent, spans_total))
    return sent_now
