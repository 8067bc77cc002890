"""Every failure of a verb becomes one line on stderr and a non-zero exit status (docs/design.md §11).

One handler, not a try/except per verb: `guarded` runs the verb, and `reason` maps whatever
escaped (a `LedgerError`, a database or driver error, an `OSError`, a missing optional driver,
Ctrl-C, or a bug) to a sentence naming what was wrong and what to do. `--debug` re-raises instead,
so the traceback is there when someone needs it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from store import DriverError, LedgerError

# SQLAlchemy and the engine helpers are imported where an error is explained, not here: a command
# that fails before opening a database (`--help`, a bad argument) never loads them.

_PROG = "rollout-ledger"
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`… | head`)

#: Optional modules → (what they are, the extra that installs them; see pyproject.toml). A
#: database driver's is its dialect's answer (`store.driver_install_hint`).
_OPTIONAL_MODULES = {
    "eventsourcing": ("the benchmark baseline eventsourcing", "bench"),
    "transfer_queue": ("TransferQueue", "transferqueue"),
    "pyarrow": ("pyarrow (Parquet export)", "export"),
    "matplotlib": ("matplotlib (the report's figures)", "report"),
    "tensorboard": ("TensorBoard", "trackers"),
    "wandb": ("Weights & Biases (wandb)", "trackers"),
}

#: Errors whose own message is already the user's reason (argument checks inside the verbs).
_PLAIN = (ValueError, LookupError)


def guarded(
    verb: Callable[[], int], *, debug: bool = False, databases: Sequence[str | None] = ()
) -> int:
    """Run `verb` and return its exit status; on failure print one line and return non-zero.

    `databases` are the URLs the verb opens (`--db`, and `--into` for replay), so that a database
    error can say which one failed. With `debug` the exception propagates with its traceback.
    """
    try:
        return verb()
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - the one place every failure is reported
        if debug:
            raise
        if isinstance(error, BrokenPipeError):
            _silence_stdout()
            return EXIT_BROKEN_PIPE
        print(f"{_PROG}: error: {reason(error, databases)}", file=sys.stderr, flush=True)
        return _exit_status(error)


async def drained(verb: Awaitable[int], *, patience: float = 1.0) -> int:
    """Await `verb`; if it fails, let the threads it started finish while the event loop still runs.

    aiosqlite stops the worker thread of a connection that failed to open without waiting for
    it; when `asyncio.run` closes the loop first, that thread dies printing a traceback of its
    own ("Event loop is closed", omnilib/aiosqlite#241). Waiting up to `patience` seconds on the
    failure path lets it hand back its result, so the one-line reason stays the only output.
    """
    before = set(threading.enumerate())
    try:
        return await verb
    except BaseException:
        deadline = time.monotonic() + patience
        started = [
            t
            for t in threading.enumerate()
            if t not in before and not t.name.startswith("asyncio_")
        ]
        while any(t.is_alive() for t in started) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        raise


_EXIT_TERMINATED = 143  # 128 + SIGTERM
_terminated = threading.Event()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Handle SIGTERM as Ctrl-C while the verb runs: its cleanup (partial files removed, the page
    in hand finished) runs the same way, and the exit says which signal ended it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        _terminated.set()
        signal.raise_signal(signal.SIGINT)  # asyncio.run turns SIGINT into a clean cancellation

    _terminated.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_status(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return _EXIT_TERMINATED if _terminated.is_set() else EXIT_INTERRUPTED
    return EXIT_ERROR


#: Python 3.11's exception groups (what a TaskGroup raises); absent on 3.10, where nothing raises one.
_EXCEPTION_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)


def reason(error: BaseException, databases: Sequence[str | None] = ()) -> str:
    """What went wrong and what to do, as one line (whitespace collapsed)."""
    text = " ".join(_reason(error, databases).split())
    return text or type(error).__name__


def _reason(error: BaseException, databases: Sequence[str | None]) -> str:
    if _EXCEPTION_GROUP is not None and isinstance(error, _EXCEPTION_GROUP):
        first = error.exceptions[0]
        more = len(error.exceptions) - 1
        return _reason(first, databases) + (f" (and {more} more error(s))" if more else "")
    if isinstance(error, KeyboardInterrupt):
        if _terminated.is_set():
            return "terminated (SIGTERM) before the command finished"
        return "interrupted (Ctrl-C) before the command finished"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled before the command finished"
    if isinstance(error, ModuleNotFoundError):
        return _missing_module(error)
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError

    from store import raised_by_driver

    # A store call's driver fault: the driver's own error (its cause) says the most.
    cause = error.__cause__ if isinstance(error, DriverError) else None
    if isinstance(cause, DBAPIError) or raised_by_driver(cause):
        return _reason(cause, databases)
    if isinstance(error, LedgerError):
        return str(error)
    if isinstance(error, DBAPIError):
        if error.connection_invalidated:
            return f"lost the connection to {_where(databases)} ({_first_line(error.orig)}): check the server and run the command again"
        return _database_error(error.orig, databases)
    if raised_by_driver(error):
        return _database_error(error, databases)
    if isinstance(error, SQLAlchemyError):
        return f"database error for {_where(databases)}: {_without_background(str(error))}; check the --db URL"
    if isinstance(error, TimeoutError) and str(error):
        return str(error)  # the library's own timeouts say what they waited for
    if isinstance(error, OSError):
        return _os_error(error, databases)
    if isinstance(error, _PLAIN):
        return str(error)
    return (
        f"internal error ({type(error).__name__}: {error}); this is a bug in {_PROG} — "
        f"rerun with --debug for the traceback and report it"
    )


def _missing_module(error: ModuleNotFoundError) -> str:
    name = (error.name or "").split(".")[0]
    hint = _OPTIONAL_MODULES.get(name) or _driver_install(name)
    if hint is not None:
        what, extra = hint
        return f"{what} is not installed: pip install -e '.[{extra}]' (in the clone)"
    return f"module {name or error} is not installed: reinstall {_PROG} with its dependencies (pip install -e .)"


def _driver_install(name: str) -> tuple[str, str] | None:
    """What to install for a missing database driver, as its dialect says; None when `store`
    itself cannot load (the missing module is one it needs, such as SQLAlchemy)."""
    try:
        from store import driver_install_hint
    except ImportError:
        return None
    return driver_install_hint(name)


# -- databases -------------------------------------------------------------------------------


def _database_error(error: BaseException | None, databases: Sequence[str | None]) -> str:
    """A driver's own error as its backend's dialect explains it (a SQLite file's problem, a
    PostgreSQL SQLSTATE's advice), or the error's first line naming the database."""
    from store import describe_driver_error

    return describe_driver_error(error, _first_line(error), _where(databases), databases)


def _os_error(error: OSError, databases: Sequence[str | None]) -> str:
    where = _where(databases)
    detail = error.strerror or str(error)
    if isinstance(error, socket.gaierror):
        return f"cannot resolve the host of {where} ({detail}): check the host name in the URL"
    if isinstance(error, ConnectionRefusedError):
        return f"cannot connect to {where} ({error}): is the server running, and do the host and port in the URL point at it?"
    if isinstance(error, ConnectionError):
        return (
            f"lost the connection to {where} ({error}): check the server and run the command again"
        )
    if isinstance(error, TimeoutError) and not error.filename:
        return f"timed out talking to {where}: check the server and the network, then run the command again"
    name = f" {error.filename}" if error.filename else ""
    if error.errno == errno.ENOSPC:
        return f"no space left on the device for{name or ' a write'}: free some disk space and run the command again"
    if isinstance(error, PermissionError):
        return f"permission denied:{name or ' ' + str(error)}: check the permissions of the file and its folder"
    if isinstance(error, IsADirectoryError):
        return f"{name.strip() or 'the path'} is a directory: pass a file path"
    if isinstance(error, FileNotFoundError):
        return f"no such file or directory:{name or ' ' + str(error)}: check the path (does its folder exist?)"
    return f"{detail}{':' + name if name else ''}"


def _where(databases: Sequence[str | None]) -> str:
    """The databases a verb opened, as a user named them (passwords hidden)."""
    if not databases:
        return "the database"
    return " or ".join(_display(url) for url in databases)


def _display(url: str | None) -> str:
    """The database as its dialect names it ("SQLite file x.db", "PostgreSQL database …")."""
    from sqlalchemy.exc import SQLAlchemyError

    from store import describe_database

    try:
        return describe_database(url)
    except (ValueError, SQLAlchemyError):  # StoreInputError (an unknown backend) is a ValueError
        return "the --db URL"


def _first_line(error: BaseException | None) -> str:
    text = _without_background(str(error)).strip() if error is not None else ""
    return (
        text.splitlines()[0]
        if text
        else type(error).__name__
        if error is not None
        else "no details"
    )


def _without_background(text: str) -> str:
    """SQLAlchemy's messages end in a '(Background on this error at: URL)' line."""
    return text.split("\n(Background on this error at:")[0]


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so flushing at exit cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
