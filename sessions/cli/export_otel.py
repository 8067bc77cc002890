"""`rollout-ledger export-otel`: a run's sessions as OpenTelemetry traces, sent over OTLP/HTTP.

The parser is added without importing anything heavy; `check` refuses bad arguments (the
endpoint, a header, the steps) before the database is opened; `run` exports as of the
projector's checkpoint with a progress bar on stderr, or with `--follow` keeps sending sessions
as they end from the follower's checkpoint until interrupted (docs/otel.md).
"""

from __future__ import annotations

import argparse

from sessions.cli.arguments import integer, number, text


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = verbs.add_parser(
        "export-otel",
        parents=[common],
        help="a run's sessions as OpenTelemetry traces, sent to an OTLP/HTTP receiver",
        description="Send a run's ended sessions (as of the projector's checkpoint) to a trace "
        "viewer as OpenTelemetry traces, one per session (docs/otel.md); with --follow, keep "
        "sending sessions as they end. Ids are derived from the sessions: sending again repeats "
        "the same spans.",
    )
    parser.add_argument(
        "--endpoint",
        required=True,
        type=text("an OTLP/HTTP URL"),
        metavar="URL",
        help="the receiver's OTLP/HTTP traces URL, e.g. http://127.0.0.1:6006/v1/traces "
        "(a URL without a path gets /v1/traces)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        type=text("KEY=VALUE"),
        metavar="KEY=VALUE",
        help="a header sent with each request (an API key, a project); repeatable",
    )
    parser.add_argument(
        "--run",
        type=text("a run name"),
        default=None,
        help="default: the most recent run (with --follow: every run)",
    )
    parser.add_argument(
        "--steps",
        default=None,
        type=text("a step range such as 0:9"),
        metavar="A:B",
        help="global steps A to B, both included (also A:, :B or N); not with --follow",
    )
    parser.add_argument(
        "--project",
        type=text("a project name"),
        default=None,
        help="the viewer's project (Phoenix: openinference.project.name); default: the run",
    )
    parser.add_argument(
        "--resource",
        action="append",
        default=[],
        type=text("KEY=VALUE"),
        metavar="KEY=VALUE",
        help="a resource attribute on every span (W&B Weave: wandb.entity, wandb.project); "
        "repeatable",
    )
    parser.add_argument(
        "--page-size",
        type=integer(1, 100_000),
        default=200,
        metavar="N",
        help="sessions read and sent per request (default 200)",
    )
    parser.add_argument(
        "--timeout",
        type=number(0.1, 3600.0),
        default=30.0,
        metavar="SECONDS",
        help="how long one request may take, retries included (default 30)",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep sending sessions as they end, from the follower's checkpoint, until Ctrl-C",
    )
    parser.add_argument(
        "--name",
        type=text("a follower name"),
        default=None,
        help="with --follow: the follower's checkpoint (default: otel); a restart goes on from it",
    )
    parser.add_argument(
        "--poll",
        type=number(0.01, 3600.0),
        default=1.0,
        metavar="SECONDS",
        help="with --follow: the wait when no session has ended (default 1)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse bad arguments before the database is opened (each a one-line ConfigError)."""
    from sessions.errors import ConfigError
    from sessions.export.dataset import parse_steps
    from sessions.otel.export import parse_header, traces_url

    args.endpoint = traces_url(args.endpoint)
    args.headers = dict(parse_header(h) for h in args.header)
    args.resource_attributes = dict(parse_header(r, flag="--resource") for r in args.resource)
    args.steps_range = parse_steps(args.steps)
    if args.follow and args.steps is not None:
        raise ConfigError("--steps selects what one export sends; --follow sends every step")
    if not args.follow and (args.name is not None):
        raise ConfigError("--name names a follower's checkpoint: use it with --follow")


async def run(args: argparse.Namespace) -> int:
    from sessions.ledger import Ledger
    from sessions.otel.export import otlp_exporter

    exporter = otlp_exporter(args.endpoint, args.headers, timeout_s=args.timeout)
    try:
        if args.follow:
            return await _follow(args, exporter)
        from sessions.cli.main import _resolve_run
        from sessions.cli.render import export_progress, print_summary
        from sessions.otel.export import export_otel

        # reads only (as of the checkpoint): the file keeps its journal mode
        async with Ledger.open(
            args.db, migrate=False, engine_options={"read_only": True}
        ) as ledger:
            run_name = await _resolve_run(ledger.engine, args.run)
            with export_progress() as advance:
                summary = await export_otel(
                    ledger,
                    exporter,
                    run=run_name,
                    steps=args.steps_range,
                    project=args.project,
                    resource=args.resource_attributes,
                    page_size=args.page_size,
                    on_progress=advance,
                )
        print_summary(summary.lines(), run_named=bool(args.run))
        return 0
    finally:
        exporter.shutdown()


async def _follow(args: argparse.Namespace, exporter: object) -> int:
    import sys

    from sessions.ledger import Ledger
    from sessions.otel.follower import DEFAULT_FOLLOWER, FollowedPage, follow_otel
    from sessions.report.text import visible

    name = args.name or DEFAULT_FOLLOWER

    def report(page: FollowedPage) -> None:
        print(
            f"sent {page.sessions} sessions ({page.spans} spans); follower {visible(name)!r} "
            f"at position {page.position}, {page.sent} sessions in all",
            flush=True,
        )

    async with Ledger.open(args.db, migrate=False) as ledger:
        print(
            f"following {'every run' if args.run is None else repr(visible(args.run))} into "
            f"{args.endpoint} as {visible(name)!r} (Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )
        await follow_otel(
            ledger,
            exporter,
            name=name,
            run=args.run,
            project=args.project,
            resource=args.resource_attributes,
            page_size=args.page_size,
            poll_s=args.poll,
            on_page=report,
        )
    return 0
