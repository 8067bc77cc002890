"""`rollout-ledger gateway --upstream URL [--upstream URL ...]` (issue 42): serve the ledger's
sessions to agents over an OpenAI-compatible endpoint until Ctrl-C or SIGTERM (docs/gateway.md).

`--db` must be a ledger already (`rollout-ledger migrate` makes one): a mistyped path is not
created. The gateway key (every session's secret derives from it) is read from `--key-file`, which is
created with a fresh random key when it does not exist, so agents' keys survive a restart.
Nothing heavy (starlette, uvicorn, httpx, the database) is imported until the verb runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

from sessions.cli.arguments import integer, text
from sessions.errors import ConfigError

__all__ = ["check", "loop_factory", "read_or_create_key", "register", "run"]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (the `gateway` extra brings it): the gateway's
    CPU per call is mostly its two HTTP hops on this loop. None: asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add the `gateway` parser (the `gateway` extra is needed only to run it)."""
    gateway = verbs.add_parser(
        "gateway",
        parents=[common],
        help="serve sessions to agents over an OpenAI-compatible endpoint (needs the gateway extra)",
    )
    gateway.add_argument(
        "--upstream",
        action="append",
        required=True,
        type=text("an inference server URL"),
        metavar="URL",
        help="an inference server's base URL (http://host:port); repeat for several",
    )
    gateway.add_argument(
        "--host", default="127.0.0.1", type=text("a host"), help="default: 127.0.0.1 (local only)"
    )
    gateway.add_argument("--port", type=integer(0, 65535), default=8000, help="default: 8000")
    gateway.add_argument(
        "--key-file",
        default="gateway.key",
        type=text("a file path"),
        metavar="PATH",
        help="the gateway key (created, mode 0600, if missing; default: gateway.key)",
    )
    gateway.add_argument(
        "--run", type=text("a run name"), default=None, help="the run sessions are recorded in"
    )
    gateway.add_argument(
        "--max-body-bytes",
        type=integer(1024, 2**31),
        default=None,
        metavar="N",
        help="largest request body accepted (default: 16 MiB)",
    )
    gateway.add_argument(
        "--weights-version-header",
        type=text("a header name"),
        default=None,
        metavar="NAME",
        help="response header naming the weights version (default: x-weights-version)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse a missing extra or a bad upstream before the database is opened."""
    from sessions.errors import MissingDependency

    for module in ("starlette", "uvicorn", "httpx"):
        try:
            __import__(module)
        except ImportError:
            raise MissingDependency(
                f"the gateway needs {module}: pip install 'rollout-ledger[gateway]' "
                "(or -e '.[gateway]' in a checkout)"
            ) from None
    for url in args.upstream:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--upstream {url!r}: give the server's base URL, http://host:port")


def read_or_create_key(path: Path) -> bytes:
    """The gateway key in `path` (hex), or a fresh one written there readable by its owner only."""
    from sessions.gateway.keys import new_gateway_key

    if path.exists():
        try:
            key = bytes.fromhex(path.read_text().strip())
        except ValueError:
            raise ConfigError(
                f"--key-file {path}: not a gateway key (hex digits); remove it to make a new one"
            ) from None
        if len(key) < 16:
            raise ConfigError(f"--key-file {path}: a gateway key has at least 16 bytes")
        return key
    key = new_gateway_key()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key.hex() + "\n")
    return key


async def run(args: argparse.Namespace) -> int:
    from sessions.gateway.server import serve
    from sessions.gateway.settings import GatewaySettings
    from sessions.ledger import Ledger

    options = {}
    if args.max_body_bytes is not None:
        options["max_body_bytes"] = args.max_body_bytes
    if args.weights_version_header is not None:
        options["weights_version_header"] = args.weights_version_header
    settings = GatewaySettings(
        upstreams=args.upstream, key=read_or_create_key(Path(args.key_file)), **options
    )
    ledger_options = {} if args.run is None else {"run": args.run}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        # a server's normal end, not an interrupted command: stop serving, settle, exit 0
        loop.add_signal_handler(signum, stop.set)
    async with (
        Ledger.open(args.db, **ledger_options) as ledger,
        serve(ledger, host=args.host, port=args.port, settings=settings) as gateway,
    ):
        print(
            f"gateway serving on {gateway.base_url} for {len(args.upstream)} inference server(s); "
            f"create sessions with POST {gateway.base_url}/sessions and the training side's key "
            f"{gateway.keys.admin_key()}",
            flush=True,
        )
        stopping = asyncio.ensure_future(stop.wait())
        serving = asyncio.ensure_future(gateway.wait())
        await asyncio.wait({stopping, serving}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if serving.done():
            serving.result()  # the server stopped by itself: its error, if it had one
    print("gateway stopped", flush=True)
    return 0
