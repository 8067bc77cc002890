"""Parquet and JSONL writers that never leave a half-written file behind.

Rows go to a temporary file in the destination's own folder (same file system, so the final
`os.replace` is atomic) and the file takes its name only once the last row group is written; on
any error, or Ctrl-C, the temporary file is removed and an older file at the path is untouched.
Parquet needs pyarrow (the `export` extra), imported only here and only when used; JSONL needs
nothing beyond the standard library.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from sessions.errors import LedgerError
from sessions.export.outputs import check_target, clean_stale, partial_path
from sessions.export.schema import (
    COLUMNS,
    OPTIONAL_SESSION_COLUMNS,
    TEXT_COLUMNS,
    Column,
    arrow_schema,
)

__all__ = [
    "ExportError",
    "FORMATS",
    "JsonlWriter",
    "ParquetWriter",
    "Page",
    "check_destination",
    "import_pyarrow",
    "made_by_export",
    "open_writer",
]

FORMATS = ("parquet", "jsonl")
#: One page of rows: column name -> one value per row (token columns hold numpy arrays or None).
Page = dict[str, list[Any]]


class ExportError(LedgerError):
    """The export cannot be written (its path, a missing extra, bad options); nothing was left at the path."""


def import_pyarrow() -> Any:
    """pyarrow, or an error naming the extra that installs it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:
        raise ExportError(
            f"writing Parquet needs pyarrow, which is not installed ({error}): pip install -e '.[export]' "
            "(or export with format='jsonl', which needs nothing more)"
        ) from None
    return pyarrow


def check_destination(path: Path) -> None:
    """Refuse, before anything is read, a path that cannot become the export file."""
    if path.is_dir():
        raise ExportError(
            f"cannot write the export to {path}: it is a directory; pass a file path such as {path / 'rollouts.parquet'}"
        )
    folder = path.parent
    if not folder.is_dir():
        raise ExportError(
            f"cannot write the export to {path}: folder {folder} does not exist; create it first (mkdir -p) or pass another path"
        )


class _Atomic:
    """A partial file beside `path` that becomes `path` on `commit`, or disappears on `abort`
    (`sessions.export.outputs`: named with the writer's pid, so the next export removes what a
    killed one left)."""

    def __init__(self, path: Path) -> None:
        check_destination(path)
        # the API replaces its own earlier output, but never a ledger database (docs/design.md §11)
        check_target(path, flag="the export's path", force=True)
        self.path = path
        clean_stale(path)
        temp = partial_path(path)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise ExportError(
                f"cannot write the export to {path}: {error.strerror or error} (creating a file in {path.parent}); "
                "check the folder's permissions and free space, or pass another path"
            ) from None
        self.temp = temp
        self.file = os.fdopen(fd, "wb")

    def commit(self) -> int:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.temp, 0o666 & ~umask)  # made private; the export is an ordinary file
        try:
            os.replace(self.temp, self.path)
        except OSError as error:
            raise ExportError(
                f"cannot write the export to {self.path}: {error.strerror or error}; nothing was written there"
            ) from None
        return self.path.stat().st_size

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        try:
            self.temp.unlink()
        except FileNotFoundError:
            pass


def made_by_export(path: Path) -> bool:
    """Whether `path` is an earlier dataset export (an empty file, or Parquet / JSONL whose
    columns are all export columns), which `export-dataset` may replace without `--force`."""
    names = {column.name for column in (*COLUMNS, *OPTIONAL_SESSION_COLUMNS, *TEXT_COLUMNS)}
    try:
        with open(path, "rb") as file:
            head = file.read(4)
            if not head:
                return True
            if head == b"PAR1":
                pa = import_pyarrow()
                found = set(pa.parquet.read_schema(path).names)
            else:
                file.seek(0)
                first = json.loads(file.readline(1 << 20))
                found = set(first) if isinstance(first, dict) else set()
    except (OSError, ValueError, ExportError):
        return False
    except Exception:  # noqa: BLE001 - pyarrow's own errors for a file that is not Parquet
        return False
    return "session_id" in found and found <= names


def _wrap_os_error(path: Path, error: OSError) -> ExportError:
    return ExportError(
        f"cannot write the export to {path}: {error.strerror or error}; nothing was written there (free space? permissions?)"
    )


class ParquetWriter:
    """Row groups of Arrow arrays built straight from the token buffers (no per-token Python)."""

    def __init__(self, path: Path, columns: Sequence[Column], *, row_group_size: int) -> None:
        self.pa = import_pyarrow()
        self.columns = tuple(columns)
        self.schema = arrow_schema(self.pa, self.columns)
        self.row_group_size = row_group_size
        self.target = _Atomic(path)
        try:
            self.writer = self.pa.parquet.ParquetWriter(
                self.target.file, self.schema, compression="zstd"
            )
        except BaseException:
            self.target.abort()
            raise

    def write(self, page: Page, rows: int) -> None:
        arrays = [
            _arrow_column(self.pa, c, field.type, page[c.name], rows)
            for c, field in zip(self.columns, self.schema)
        ]
        batch = self.pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        try:
            self.writer.write_batch(batch, row_group_size=self.row_group_size)
        except OSError as error:
            raise _wrap_os_error(self.target.path, error) from None

    def commit(self) -> int:
        try:
            self.writer.close()
        except OSError as error:
            raise _wrap_os_error(self.target.path, error) from None
        return self.target.commit()

    def abort(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - the file is thrown away anyway
            pass
        self.target.abort()


def _arrow_column(pa: Any, column: Column, arrow_type: Any, values: list[Any], rows: int) -> Any:
    if not column.type.startswith("list<"):
        return pa.array(values, type=arrow_type)
    dtype = {"list<int32>": np.int32, "list<uint8>": np.uint8, "list<float32>": np.float32}[
        column.type
    ]
    lengths = np.fromiter((0 if v is None else len(v) for v in values), dtype=np.int64, count=rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [v for v in values if v is not None]
    flat = (
        np.concatenate(present).astype(dtype, copy=False) if present else np.empty(0, dtype=dtype)
    )
    if offsets[-1] >= 2**31:
        raise ExportError(
            f"one row group would hold {offsets[-1]} {column.name} values (over 2^31): pass a smaller row_group_size"
        )
    mask = pa.array(np.fromiter((v is None for v in values), dtype=bool, count=rows))
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(flat), type=arrow_type, mask=mask
    )


class JsonlWriter:
    """One JSON object per line, the same keys and values as the Parquet columns (timestamps as
    ISO 8601 text with their UTC offset)."""

    def __init__(self, path: Path, columns: Sequence[Column], *, row_group_size: int) -> None:
        self.columns = tuple(columns)
        self.target = _Atomic(path)

    def write(self, page: Page, rows: int) -> None:
        names = [c.name for c in self.columns]
        lists = [page[name] for name in names]
        lines = []
        for i in range(rows):
            lines.append(
                json.dumps(
                    {name: _json_value(values[i]) for name, values in zip(names, lists)},
                    ensure_ascii=False,
                    allow_nan=False,
                )
            )
        try:
            self.target.file.write(("\n".join(lines) + "\n").encode("utf-8") if lines else b"")
        except OSError as error:
            raise _wrap_os_error(self.target.path, error) from None

    def commit(self) -> int:
        try:
            return self.target.commit()
        except OSError as error:
            raise _wrap_os_error(self.target.path, error) from None

    def abort(self) -> None:
        self.target.abort()


def _json_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no infinity; the ledger refuses non-finite rewards at append anyway
    return value


def open_writer(
    format: str, path: Path, columns: Sequence[Column], *, row_group_size: int
) -> ParquetWriter | JsonlWriter:
    if format == "parquet":
        return ParquetWriter(path, columns, row_group_size=row_group_size)
    if format == "jsonl":
        return JsonlWriter(path, columns, row_group_size=row_group_size)
    raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
