"""Database and driver faults as `DriverError`: what a store call lets out when the database fails.

SQLAlchemy's errors (a `DBAPIError` wraps the driver's own) and the drivers' own errors reach a
caller of `store` as one `DriverError` that names what the store was doing and what to do, with
the driver's error chained as `__cause__`: `except StoreError` (or `LedgerError`) catches every
fault, and `store.is_transient` still tells a dropped connection from a damaged file through it.
Which errors are a driver's, and what its texts mean, each backend's dialect answers.
Store calls wrap themselves with `wrapped` (a context manager) or `@wraps_faults` (a decorator of
async functions); the append path wraps its outcomes in `EventStore` itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from store.dialects import raised_by_driver, registered
from store.errors import DriverError
from store.retry import is_transient

__all__ = ["driver_error", "is_driver_error", "wrapped", "wraps_faults"]

P = ParamSpec("P")
T = TypeVar("T")


def is_driver_error(error: BaseException) -> bool:
    """SQLAlchemy's error, or a registered driver's own (its dialect knows it by its class)."""
    return isinstance(error, SQLAlchemyError) or raised_by_driver(error)


def driver_error(what: str, error: BaseException) -> DriverError:
    """`error` as the `DriverError` to raise `from` it: the driver's message without SQLAlchemy's
    statement and parameters (which can be the whole batch), and what to do."""
    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    text = str(cause).split("\n(Background on this error at:")[0].strip()
    kind = type(cause).__name__
    detail = f"{text} (the driver's {kind})" if text else kind
    if any(dialect.disk_full(text) for dialect in registered()):
        advice = (
            "the disk the database is on is full: free space there, then run the same command "
            "again (the failed statement wrote nothing)"
        )
    elif is_transient(error):
        advice = (
            "the connection dropped or a lock was not had in time (retried already where that "
            "is safe): run it again once the database answers"
        )
    else:
        advice = "the database refused it (the driver's error, chained as the cause, says why)"
    return DriverError(f"{what} failed: {detail}; {advice}", what=what)


@contextlib.contextmanager
def wrapped(what: str) -> Iterator[None]:
    """Turn a driver fault inside the block into `DriverError` (`what` names the block's job);
    every other error, and a `DriverError` from an inner store call, passes as it is."""
    try:
        yield
    except DriverError:
        raise
    except Exception as error:
        if is_driver_error(error):
            raise driver_error(what, error) from error
        raise


def wraps_faults(
    what: str | None = None,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """`wrapped` around every call of an async function; `what` defaults to its name."""

    def decorate(function: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        label = what or function.__name__.replace("_", " ")

        @functools.wraps(function)
        async def call(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return await function(*args, **kwargs)
            except DriverError:
                raise
            except Exception as error:
                if is_driver_error(error):
                    raise driver_error(label, error) from error
                raise

        return call

    return decorate
