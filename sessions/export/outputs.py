"""Where a verb may write (docs/design.md §11): never over a ledger, never over what it did not make.

Three rules, checked before anything is read or drawn:

- An output path that is a ledger's database file, or its ``-wal`` / ``-shm`` / ``-journal``
  beside it, by any spelling or through a symlink, is refused; so is any SQLite file that holds a
  ledger. ``--force`` does not lift this: a typo must never replace the event log.
- Any other existing file (or folder) is replaced only if a verb of this library made it (each
  verb says how to recognise its own output), or with ``--force``.
- What is written goes beside the target first and takes its place whole (``os.replace`` of a file,
  two renames of a folder), so a killed verb leaves the old output, never a mix. Partial files and
  folders a killed verb left are removed by the next run (their names carry the writer's pid).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from sessions.errors import LedgerError
from store import holds_ledger, local_database_file

__all__ = [
    "OutputRefused",
    "check_target",
    "clean_stale",
    "holds_ledger",  # re-exported from store: what counts as a ledger file
    "partial_file",
    "partial_path",
    "replaced_folder",
]

#: Files SQLite keeps beside a database; writing over any of them corrupts the ledger.
_SIDECARS = ("", "-wal", "-shm", "-journal")


class OutputRefused(LedgerError, ValueError):
    """An output path a verb must not write: a ledger, or an existing file it did not make."""


def _ledger_files(databases: Iterable[str | None]) -> set[Path]:
    """The resolved paths of every SQLite file (and its sidecars) behind these database URLs."""
    found: set[Path] = set()
    for database in databases:
        path = local_database_file(database)
        if path is None:
            continue
        resolved = Path(os.path.realpath(path))
        found.update(resolved.with_name(resolved.name + suffix) for suffix in _SIDECARS)
    return found


def check_target(
    out: str | os.PathLike[str],
    *,
    flag: str,
    databases: Iterable[str | None] = (),
    force: bool = False,
    made_here: Callable[[Path], bool] = lambda _path: False,
) -> Path:
    """Refuse `out` unless a verb may write it; returns it as a `Path`.

    `flag` names the option in messages (``--out``); `databases` are the ledgers this command
    reads (their files are never a target); `made_here(path)` says whether an existing target is
    this verb's own earlier output, which it may replace without `force`.
    """
    text = os.fspath(out)
    if not text.strip():
        raise OutputRefused(f"{flag} is empty: pass the path to write")
    path = Path(text)
    resolved = Path(os.path.realpath(path))
    for name in (resolved, *_sidecar_owner(resolved)):
        if name in _ledger_files(databases):
            raise OutputRefused(
                f"{flag} {text} is the ledger database this command reads ({name.name}); writing "
                "there would replace the event log — pass another path"
            )
    if resolved.is_file() and holds_ledger(resolved):
        raise OutputRefused(
            f"{flag} {text} is a SQLite file that holds a ledger; rollout-ledger never writes over "
            "one — pass another path"
        )
    for owner in _sidecar_owner(resolved):
        if owner.is_file() and holds_ledger(owner):
            raise OutputRefused(
                f"{flag} {text} belongs to the ledger database {owner.name} beside it; pass "
                "another path"
            )
    if resolved.exists() and not force and not made_here(resolved):
        raise OutputRefused(
            f"{flag} {text} exists and was not written by this verb; pass --force to replace it, "
            "or another path"
        )
    return path


def _sidecar_owner(path: Path) -> list[Path]:
    """The database a `-wal` / `-shm` / `-journal` path would belong to (none for other names)."""
    return [
        path.with_name(path.name[: -len(suffix)])
        for suffix in _SIDECARS[1:]
        if path.name.endswith(suffix) and len(path.name) > len(suffix)
    ]


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _partial_pattern(path: Path, kind: str) -> re.Pattern[str]:
    # a partial SQLite file (a backup) may have left its -journal, -wal or -shm beside it
    sidecar = "(?:-journal|-wal|-shm)?" if kind == "part" else ""
    return re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]+\.{kind}{sidecar}$")


def clean_stale(path: Path) -> None:
    """Remove what a killed writer of `path` left beside it: partial files and new folders of
    writers that are gone, and put back a folder that was moved aside but not yet replaced."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return
    kinds = {kind: _partial_pattern(path, kind) for kind in ("part", "new", "old")}
    # what mkstemp named a partial export before the names carried a pid: its writer is long gone
    legacy = re.compile(rf"^\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.part$")
    for entry in folder.iterdir():
        if legacy.match(entry.name) and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
            continue
        for kind, pattern in kinds.items():
            found = pattern.match(entry.name)
            if found is None or _alive(int(found.group(1))):
                continue
            if kind == "old" and not path.exists():
                os.replace(entry, path)  # the swap was cut between its two renames
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()


def _beside(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}")


def partial_path(path: Path) -> Path:
    """A fresh name beside `path` for a partial file (`clean_stale` recognises it later)."""
    return _beside(path, "part")


@contextlib.contextmanager
def partial_file(path: Path) -> Iterator[Path]:
    """A path beside `path` to write; it replaces `path` when the block ends, or is removed if the
    block raises (Ctrl-C and SIGTERM included), with the -journal, -wal or -shm a SQLite writer
    left beside it."""
    clean_stale(path)
    partial = _beside(path, "part")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        for leftover in (partial, *(Path(f"{partial}{suffix}") for suffix in _SIDECARS[1:])):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


@contextlib.contextmanager
def replaced_folder(path: Path) -> Iterator[Path]:
    """A new folder beside `path` to fill; when the block ends it takes `path`'s place (the old
    one is moved aside, the new one renamed in, the old one removed), or is removed if it raises."""
    clean_stale(path)
    new = _beside(path, "new")
    new.mkdir()
    try:
        yield new
        if path.exists():
            old = _beside(path, "old")
            os.replace(path, old)
            os.replace(new, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(new, path)
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)
