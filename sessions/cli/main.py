"""`rollout-ledger`: the command line (docs/design.md §11). Exit 0 on success; otherwise a one-line
reason on stderr and a non-zero status."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

from sessions.cli.arguments import integer, number, rate, text
from sessions.cli.errors import EXIT_ERROR, drained, guarded, terminate_as_interrupt
from sessions.errors import ConfigError, NotFound

# Each verb imports what it needs when it runs: building the parser (and `--help`) loads no
# database, array or tensor library (tests/cli/test_startup.py holds the start-up time).

_DEBUG_HELP = "on failure, show the traceback instead of the one-line reason"


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before and after the verb; SUPPRESS keeps a verb from resetting it to False.
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    common = argparse.ArgumentParser(add_help=False, parents=[flags])
    common.add_argument(
        "--db",
        default=None,
        type=text("a database URL or SQLite file path"),
        help="database URL or SQLite file path (default: $ROLLOUT_LEDGER_DB, else rollouts.db in the working directory)",
    )
    parser = argparse.ArgumentParser(
        prog="rollout-ledger", description="Event-sourced rollout sessions for agentic RL."
    )
    parser.add_argument("--debug", action="store_true", default=False, help=_DEBUG_HELP)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    demo = verbs.add_parser(
        "demo", parents=[common], help="simulated agent rollouts, recorded and projected"
    )
    demo.add_argument("--steps", type=integer(1, 100_000), default=2)
    demo.add_argument(
        "--start-step",
        type=integer(0, 2**62, "a step"),
        default=0,
        metavar="N",
        help="grow the existing run --run NAME with steps N.. (refused if it has steps >= N "
        "or other demo settings)",
    )
    demo.add_argument("--prompts", type=integer(1, 100_000), default=16)
    demo.add_argument("--group-size", type=integer(1, 1024), default=4)
    demo.add_argument("--fail-rate", type=rate, default=0.2)
    demo.add_argument("--cancel-rate", type=rate, default=0.05)
    demo.add_argument("--seed", type=integer(0, 2**63 - 1), default=0)
    demo.add_argument(
        "--run", type=text("a run name"), default=None, help="run name (default: a new unique name)"
    )
    demo.add_argument(
        "--reuse-uids",
        action="store_true",
        help="the same uids at every step (dataset prompt ids as uids); each step's groups stay their own",
    )
    demo.add_argument(
        "--max-attempts",
        type=integer(1, 100),
        default=1,
        metavar="N",
        help="attempts per session: infrastructure failures are retried up to N attempts in all (default 1)",
    )
    demo.add_argument(
        "--exclude-infra",
        action="store_true",
        help="metric policy: leave infrastructure failures out of reward/mean (reward/mean_default_rule keeps them)",
    )
    demo.add_argument(
        "--keep-partial",
        action="store_true",
        help="placeholder policy: a timed-out session's verified partial trajectory goes to the batch",
    )
    demo.add_argument(
        "--calls",
        type=integer(0, 64),
        default=0,
        metavar="N",
        help="model calls per session, each recorded as it happens and the row assembled from "
        "them (default 0: each session hands over a whole trajectory)",
    )
    demo.add_argument(
        "--outage-from-step",
        type=integer(0, 2**62, "a step"),
        default=None,
        metavar="N",
        help="the sandbox service is down from step N on: every session fails sandbox_error, "
        "until the run's circuit breaker halts it (RunHalted); resume with --start-step",
    )

    project = verbs.add_parser(
        "project", parents=[common], help="run the projector to the end of the log"
    )
    project.add_argument(
        "--follow", action="store_true", help="keep tailing the log until interrupted"
    )
    project.add_argument(
        "--poll",
        type=number(0.001, 3600.0, "seconds"),
        default=0.5,
        help="seconds between polls when following",
    )
    project.add_argument(
        "--backoff",
        type=number(0.001, 3600.0, "seconds"),
        default=0.5,
        help="first wait after a failed page when following (doubles)",
    )
    project.add_argument(
        "--max-backoff",
        type=number(0.001, 86_400.0, "seconds"),
        default=30.0,
        help="longest wait between retries of a failed page",
    )

    replay = verbs.add_parser(
        "replay",
        parents=[common],
        help="rebuild every read model from events into another database",
    )
    replay.add_argument(
        "--into",
        required=True,
        type=text("a database URL or SQLite file path"),
        metavar="URL",
        help="an empty database (created and migrated if needed)",
    )
    _workers_flag(replay)

    audit = verbs.add_parser(
        "audit", parents=[common], help="replay in isolation and compare with what is stored"
    )
    _workers_flag(audit)

    sql = verbs.add_parser(
        "sql", parents=[common], help="run a read-only SQL query and print a table"
    )
    sql.add_argument("query", type=text("a SELECT statement"))
    sql.add_argument(
        "--limit", type=integer(0, 10**9), default=None, help="print at most this many rows"
    )
    sql.add_argument("--json", action="store_true", help="print rows as JSON objects")
    sql.add_argument(
        "--timeout",
        type=number(0.0, 86_400.0, "seconds"),
        default=30.0,
        metavar="SECONDS",
        help="stop the statement after this long (default: 30; 0 for no limit)",
    )

    recover = verbs.add_parser(
        "recover",
        parents=[common],
        help="fail sessions left open by a dead process (reason orphaned)",
    )
    recover.add_argument(
        "--older-than",
        required=True,
        type=text("a duration such as 30m"),
        metavar="DURATION",
        help="idle time, e.g. 30m, 2h",
    )
    recover.add_argument(
        "--run", type=text("a run name"), default=None, help="only this run (default: all runs)"
    )

    migrate = verbs.add_parser(
        "migrate",
        parents=[common],
        help="upgrade the schema to head, in one transaction (all revisions or none)",
    )
    migrate.add_argument(
        "--share-database",
        action="store_true",
        help="make the ledger in a database that already holds another application's tables "
        "(refused without this flag)",
    )

    diagram = verbs.add_parser(
        "diagram", parents=[flags], help="the state machine, drawn from the machine itself"
    )
    diagram.add_argument("--format", choices=("mermaid",), default="mermaid")
    for module in _VERB_MODULES.values():
        importlib.import_module(module).register(verbs, common)
    return parser


#: Verbs whose parser and handler live in a module of their own: `register(verbs, common)` adds
#: the parser (importing nothing heavy), `async run(args) -> int` runs the verb, and an optional
#: `check(args)` refuses bad arguments before any database is opened.
_VERB_MODULES = {
    "metrics": "sessions.cli.metrics",
    "history": "sessions.cli.history",
    "backup": "sessions.cli.backup",
    "export": "sessions.cli.export_batch",
    "export-dataset": "sessions.cli.export_dataset",
    "export-otel": "sessions.cli.export_otel",
    "prune": "sessions.cli.prune",
    "report": "sessions.cli.report",
    "gateway": "sessions.cli.gateway",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the verb, and report any failure as one line (see `sessions.cli.errors`)."""
    args = build_parser().parse_args(argv)
    databases = (
        [args.db, args.into] if args.verb == "replay" else [args.db] if hasattr(args, "db") else []
    )
    with terminate_as_interrupt():  # SIGTERM cleans up as Ctrl-C does
        return guarded(lambda: _run(args), debug=args.debug, databases=databases)


def _run(args: argparse.Namespace) -> int:
    """The verb in an event loop of its own: the one its module's `loop_factory()` names (the
    gateway's uvloop, when installed), else asyncio's, as `asyncio.run` makes it."""
    factory = None
    module = _VERB_MODULES.get(args.verb)
    if module is not None:
        choose = getattr(importlib.import_module(module), "loop_factory", None)
        factory = choose() if choose is not None else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(drained(_dispatch(args)))


#: The verbs that may create or migrate the `--db` database (docs/design.md §11); `replay` creates only
#: its `--into` target. Every other verb opens an existing ledger at head, or refuses in one line.
CREATING_VERBS = frozenset({"demo", "migrate"})


async def _dispatch(args: argparse.Namespace) -> int:
    module = _VERB_MODULES.get(args.verb)
    if module is not None:
        verb = importlib.import_module(module)
        handler = verb.run
        if hasattr(verb, "check"):
            verb.check(args)
    else:
        handler = globals()[f"_cmd_{args.verb}"]
    _check_arguments(args)
    if hasattr(args, "db") and args.verb not in CREATING_VERBS:
        await _require_ledger(args.db)
    return await handler(args)


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments before any database is opened: they are the first thing to fix."""
    if args.verb == "project" and args.follow and not 0 < args.backoff <= args.max_backoff:
        raise ConfigError(
            f"need 0 < --backoff <= --max-backoff, got --backoff {args.backoff} "
            f"--max-backoff {args.max_backoff}"
        )
    if args.verb == "recover":
        from sessions.runs.recovery import parse_duration

        parse_duration(args.older_than)


async def _require_ledger(db: str | None) -> None:
    """Refuse, before the verb opens it, a `--db` that is not an existing ledger at head.

    Reads only: a mistyped path is not created, and another application's file is neither
    migrated nor switched to WAL (the SQLite checks run before any connection is made).
    """
    from store import (
        OPEN_ATTEMPTS,
        check_schema,
        create_engine,
        local_database_file,
        retry_transient,
    )

    engine = create_engine(db, require_ledger=True)
    try:
        if local_database_file(db) is None:  # a local file was checked, read-only, by create_engine
            await retry_transient(
                lambda: check_schema(engine),
                what="open (schema check)",
                attempts=OPEN_ATTEMPTS,
                connecting=engine.url,
            )
    finally:
        await engine.dispose()


async def _resolve_run(engine: Any, requested: str | None, *, conn: Any = None) -> str:
    """`--run`, or the run of the log's most recent event (on `conn` when one is open)."""
    from store import read_models as rm

    if requested:
        return requested
    if conn is None:
        async with engine.connect() as own:
            latest = await rm.latest_run(own)
    else:
        latest = await rm.latest_run(conn)
    if latest is None:
        raise NotFound(
            "the database has no events yet; record sessions (or run `rollout-ledger demo`) first"
        )
    return latest


async def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from sessions.cli.demo import DemoConfig, example_session, new_run_name, next_commands, run_demo
    from sessions.cli.render import console as make_console
    from sessions.cli.render import summary_table
    from sessions.ledger import Ledger

    config = DemoConfig(
        args.steps,
        args.prompts,
        args.group_size,
        args.fail_rate,
        args.cancel_rate,
        args.seed,
        reuse_uids=args.reuse_uids,
        max_attempts=args.max_attempts,
        exclude_infra=args.exclude_infra,
        keep_partial=args.keep_partial,
        start_step=args.start_step,
        calls=args.calls,
        outage_from_step=args.outage_from_step,
    )
    if args.start_step and not args.run:
        raise ConfigError("--start-step grows an existing run: name it with --run NAME")
    run = args.run or new_run_name()
    console = make_console()
    total = config.steps * 2 * config.prompts * config.group_size
    # growing a run is a new launch of it (a resume): it re-arms a run its breaker halted
    import uuid

    from sessions.cli.demo import policies

    launch = f"demo-from-step-{args.start_step}-{uuid.uuid4().hex[:8]}" if args.start_step else None
    async with Ledger.open(args.db, run=run, launch=launch, **policies(config)) as ledger:
        if args.start_step:
            await _check_start_step(ledger, run, args.start_step)
        with Progress(
            TextColumn("[bold]rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("sessions", total=total)
            figures = await run_demo(ledger, config, on_session=lambda: progress.advance(task))
        projected = await ledger.project()
        rows = await ledger.metrics()
    console.print(summary_table(rows, f"run {run} — db {_display(args.db)}"))
    console.print(
        Text(
            f"\nrecorded {int(figures['events'])} events from {total} sessions in {figures['seconds']:.1f}s "
            f"(mostly the simulated agents' waits and hangs); projected {projected} events"
        )
    )
    console.print(
        Text(
            "reward/mean counts failed sessions as zeros (placeholders); reward/mean_success_only is the "
            "survivors-only figure other frameworks report. reward/mean@N is verl's val-core headline: the uids "
            "with N rows only (those that lost a session are counted under 'uids not @N'); reward/mean_per_uid "
            "averages every uid."
        )
    )
    console.print(Text("\nnext, try:"))
    for command in next_commands(run, args.db, example_session(run, config)):
        console.print(Text(f"  {command}"), soft_wrap=True)
    return 0


async def _check_start_step(ledger: Any, run: str, start: int) -> None:
    """Refuse to grow `run` from step `start` unless it exists and every step it has is below."""
    steps = {row.global_step for row in await ledger.metrics(run=run)} - {None}
    if not steps:
        raise NotFound(
            f"run {run!r} has no steps to grow; run `demo --run {run}` without --start-step first"
        )
    if max(steps) >= start:
        raise ConfigError(
            f"run {run!r} already has steps up to {max(steps)}; --start-step must be above it "
            f"(--start-step {max(steps) + 1})"
        )


def _display(db: str | None) -> str:
    from sqlalchemy.engine import make_url

    from store import normalize_url

    return make_url(normalize_url(db)).render_as_string(hide_password=True)


async def _cmd_project(args: argparse.Namespace) -> int:
    from sessions.ledger import Ledger
    from store import read_models as rm

    async with Ledger.open(args.db, migrate=False) as ledger:
        if not args.follow:
            async with ledger.engine.connect() as conn:
                before = await rm.get_checkpoint(conn)
            count = await ledger.project()
            print(f"projected {count} events")
            await _report_quarantined(ledger, after=before)
            return 0
        ledger.projector.hold_batches = (
            False  # nobody asks this process for batches: hold no payloads
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)  # finish the page in hand, then exit 0

        def page(r: Any) -> None:
            quarantined = (
                f", {r.quarantined} quarantined (see projection_errors)" if r.quarantined else ""
            )
            print(
                f"projected {r.events} events up to position {r.last_position}{quarantined}",
                flush=True,
            )

        total = await ledger.projector.follow(
            stop,
            poll_interval=args.poll,
            backoff=args.backoff,
            max_backoff=args.max_backoff,
            on_page=page,
        )
        print(f"projected {total} events")
    return 0


async def _report_quarantined(ledger: Any, *, after: int) -> None:
    """Name every event this projection quarantined (docs/design.md §7), a line each, on stdout."""
    from store import read_models as rm

    async with ledger.engine.connect() as conn:
        errors = await rm.projection_error_rows(conn, after=after)
    if not errors:
        return
    print(
        f"{len(errors)} event(s) could not be projected and were quarantined (table projection_errors; "
        "`rollout-ledger audit` reports them too):"
    )
    for error in errors:
        where = f" field {error['field']}:" if error["field"] else ""
        print(
            f"  position {error['position']} {error['type']} of session {error['session_id']!r}:{where} "
            f"{error['reason']} -> {error['outcome']}"
        )


def _workers_flag(verb: argparse.ArgumentParser) -> None:
    """replay's and audit's `--workers`: the processes the fold of the log runs in."""
    verb.add_argument(
        "--workers",
        type=integer(1, 256, "processes"),
        default=None,
        metavar="N",
        help="processes to fold the log in (1: this one; default: with 3 or more cores and a log "
        "of 50,000 events or more, one per core but this one's, at most 4, else 1); the result "
        "is the same either way",
    )


async def _cmd_replay(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from sessions.audit.replay import replay
    from store import check_schema, create_engine, upgrade

    source, target = create_engine(args.db, read_only=True), create_engine(args.into)
    try:
        await check_schema(source)  # the source is only read; the target is created and migrated
        await upgrade(target)
        with Progress(transient=True) as progress:
            task = progress.add_task("replaying", total=None)
            report = await replay(
                source,
                target,
                on_events=lambda n: progress.advance(task, n),
                workers=args.workers,
            )
    finally:
        await source.dispose()
        await target.dispose()
    print(
        f"replayed {report.events} events into {_display(args.into)} in {report.seconds:.2f}s ({report.events_per_second:,.0f} events/s)"
    )
    return 0


async def _cmd_audit(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from sessions.audit.auditing import audit
    from store import check_schema, create_engine

    engine = create_engine(args.db, read_only=True)  # reads only: the file keeps its journal mode
    try:
        await check_schema(engine)
        with Progress(transient=True) as progress:
            task = progress.add_task("auditing", total=None)
            report = await audit(
                engine,
                on_progress=lambda _what, n: progress.advance(task, n),
                workers=args.workers,
            )
    finally:
        await engine.dispose()
    print(f"audited {report.sessions} sessions, {report.events} events in {report.seconds:.2f}s")
    if report.ok:
        print(
            "audit passed: the stored read models, metrics and queue rows equal a replay of the log"
        )
        return 0
    print(
        f"audit FAILED: {len(report.divergences)} divergence(s); first: {report.divergences[0]}",
        file=sys.stderr,
    )
    return EXIT_ERROR


async def _cmd_sql(args: argparse.Namespace) -> int:
    from sessions.cli.render import json_value, print_json, rows_table, show
    from store import check_schema, console, create_engine

    engine = create_engine(args.db, read_only=True)  # reads only: the file keeps its journal mode
    try:
        await check_schema(engine)
        columns, rows = await console.run_query(
            engine, args.query, limit=args.limit, timeout=args.timeout
        )
        behind = await console.projector_lag(engine)
    finally:
        await engine.dispose()
    if args.json:
        print_json([{c: json_value(v) for c, v in zip(columns, row)} for row in rows])
    else:
        show(rows_table(columns, rows), f"{len(rows)} row(s)")
    if behind:  # `sql` only reads, so it reports the lag rather than projecting (docs/sql.md)
        print(
            f"note: the read models are {behind} event(s) behind the log; run `rollout-ledger project` "
            "to bring them up to date",
            file=sys.stderr,
        )
    return 0


async def _cmd_recover(args: argparse.Namespace) -> int:
    from sessions.ledger import Ledger
    from sessions.runs.recovery import parse_duration, recover

    older_than = parse_duration(args.older_than)
    async with Ledger.open(args.db, migrate=False) as ledger:
        failed = await recover(ledger, older_than, run=args.run)
        await ledger.project()
    print(
        f"failed {len(failed)} orphaned session(s)"
        + (": " + ", ".join(failed[:20]) + (" …" if len(failed) > 20 else "") if failed else "")
    )
    return 0


async def _cmd_migrate(args: argparse.Namespace) -> int:
    from store import create_engine, current_revision, upgrade

    engine = create_engine(args.db)
    try:
        before = await current_revision(engine)
        await upgrade(engine, share=args.share_database)
        after = await current_revision(engine)
    finally:
        await engine.dispose()
    print(
        f"schema at {after}" + ("" if before == after else f" (was {before or 'no ledger schema'})")
    )
    return 0


async def _cmd_diagram(args: argparse.Namespace) -> int:
    from sessions.machine import mermaid

    print(mermaid())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
