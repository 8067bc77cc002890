"""`rollout-ledger history`: one session's events and its state, now or as of a position.

A fold of the session's own events through the event store: no projection, so no `Ledger` (nor
its start-up: the recorder, the projector, numpy; issue 28).
"""

from __future__ import annotations

import argparse

from sessions.cli.arguments import integer, text


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = verbs.add_parser("history", parents=[common], help="a session's events and state")
    parser.add_argument("session_id", type=text("a session id"))
    parser.add_argument("--at", type=integer(0, 2**63 - 1), default=None, metavar="POSITION")


async def run(args: argparse.Namespace) -> int:
    from sessions.audit.history import session_history
    from sessions.cli.render import history_table, print_table
    from store import EventStore, create_engine, normalize_url

    engine = create_engine(normalize_url(args.db), read_only=True)
    store = EventStore(engine)
    try:
        rows, view = await session_history(store, args.session_id, at_position=args.at)
    finally:
        await store.close()
        await engine.dispose()
    print_table(history_table(args.session_id, rows))
    where = "now" if args.at is None else f"as of position {args.at}"
    reason = f" ({view.failure_reason})" if view.failure_reason else ""
    print(
        f"state {where}: {view.state}{reason}; version {view.version}; "
        f"trajectories {len(view.trajectories)}; reward {view.reward}"
    )
    return 0
