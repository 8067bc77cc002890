"""What SQLite's errors look like, and what the CLI tells a user about each (`SqliteDialect`).

sqlite3 (and aiosqlite, which raises sqlite3's errors) reports everything as text: a busy file
as "database is locked", a full disk as "database or disk is full". The CLI's one-line hints
below go by those texts; for a file that cannot be opened or written, the file system is asked
why first (a directory, a read-only mount, a full device, the file's mode), since SQLite's own
words ("unable to open database file", "disk I/O error") do not say.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from sqlalchemy.engine import URL

__all__ = ["DISK_FULL_TEXTS", "FILE_PROBLEM_TEXTS", "HINTS", "LOCK_TIMEOUT_TEXTS", "describe"]

#: A lock not had within the busy timeout (`store.retry` retries it).
LOCK_TIMEOUT_TEXTS = ("database is locked",)
#: SQLITE_FULL ("database or disk is full").
DISK_FULL_TEXTS = ("disk is full",)

#: Message fragment -> what it means and what to do ({where} names the database, {message} is
#: the driver's first line). The first fragment found in the message wins.
HINTS = (
    (
        "unable to open database file",
        "cannot open {where} ({message}): --db must name a SQLite file, not a "
        "directory, in a folder this process may read and write",
    ),
    (
        "file is not a database",
        "{where} is not a database (file is not a database): point --db at a "
        "rollout-ledger database, or restore the file from a backup",
    ),
    (
        "malformed",
        "{where} is damaged ({message}): restore it from a backup (`sqlite3 FILE .recover` may salvage rows)",
    ),
    (
        "locked",
        "{where} is locked by another process ({message}): wait for it to finish, or raise the busy timeout",
    ),
    (
        "readonly",
        "cannot write to {where} ({message}): check the permissions of the file and its folder",
    ),
    (
        "disk is full",
        "no space left for {where} ({message}): free some disk space and run the command again",
    ),
    (
        "no such table",
        "{where}: {message}; the database lacks a table its schema revision promises, so it was "
        "altered outside rollout-ledger — restore it from a backup",
    ),
    (
        "no such column",
        "{where}: {message}; the database lacks a column its schema revision promises, so it was "
        "altered outside rollout-ledger — restore it from a backup",
    ),
    ("disk i/o error", "input/output error on {where} ({message}): check the disk and the file"),
)
#: Messages after which the file system is asked what is wrong with the file (`_file_problem`).
FILE_PROBLEM_TEXTS = ("unable to open database file", "disk i/o error", "readonly")


def describe(
    message: str, where: str, urls: Sequence[URL], local_file: Callable[[URL], str | None]
) -> str | None:
    """The CLI's line for a SQLite error whose first line is `message`, or None (no hint).

    `urls` are the verb's SQLite databases; `local_file` maps one to the file it opens (None: in
    memory)."""
    lowered = message.lower()
    if any(text in lowered for text in FILE_PROBLEM_TEXTS):
        problem = _file_problem(urls, message, local_file)
        if problem:
            return problem
    for fragment, template in HINTS:
        if fragment in lowered:
            return template.format(where=where, message=message)
    return None


def _file_problem(
    urls: Sequence[URL], message: str, local_file: Callable[[URL], str | None]
) -> str | None:
    """Why SQLite could not open or write a file among `urls`, when the file system can tell.

    SQLite reports a full disk as "disk I/O error" when it cannot even create the -shm file, and a
    read-only mount as a permission problem; the file system says which it was.
    """
    for url in urls:
        path = local_file(url)
        if path is None:
            continue
        if os.path.isdir(path):
            return f"{path} is a directory, not a SQLite file: pass a file path such as {os.path.join(path, 'rollouts.db')}"
        if "readonly" in message.lower() and _opened_read_only(url):
            return (
                f"the --db URL opens SQLite file {path} read-only ({message}), and this command writes to it "
                "(it projects the log's new events into the read models): drop mode=ro / immutable=1 from the URL"
            )
        folder = os.path.dirname(os.path.abspath(path))
        try:
            disk = os.statvfs(folder)
        except OSError:
            continue
        if disk.f_flag & os.ST_RDONLY:
            return (
                f"SQLite file {path} is on a read-only file system ({message}); a ledger (a WAL database) "
                "writes beside its file even to be read: copy it somewhere writable, or remount the file system read-write"
            )
        if disk.f_bavail == 0 and "disk i/o error" in message.lower():
            return f"no space left on the device holding SQLite file {path} ({message}): free some disk space and run the command again"
        if os.path.exists(path) and os.access(path, os.R_OK) and not os.access(path, os.W_OK):
            return (
                f"SQLite file {path} is read-only for this process ({message}), and this command writes to it: "
                "check its owner, mode and attributes (chmod u+w, lsattr), or copy it somewhere writable"
            )
        if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            return f"permission denied: this process may not read and write the SQLite file {path}; check its owner and mode"
    return None


def _opened_read_only(url: URL) -> bool:
    """Whether the URL opens its file read-only (`mode=ro`, `immutable=1`)."""
    query = url.query
    return "ro" in str(query.get("mode", "")).lower() or str(
        query.get("immutable", "")
    ).lower() in ("1", "true")
