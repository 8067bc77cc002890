"""Backend knowledge lives in `store/dialects/` only (docs/architecture.md).

Outside it — in `sessions/` and the rest of `store/` — no code imports one backend's dialect
module (only the registry, `store.dialects`, and the questions, `store.dialects.base`), imports
or uses a driver module, names one in a string, writes a SQLSTATE (a five-character code, or a two-character class used
as a code's prefix), reads a driver error's own attributes (`sqlstate`, `pgcode`, …), or holds a
driver's message text. The driver modules are the registered dialects' `driver_modules` plus the
drivers a third backend would bring; the message texts are the dialects' own declared tables
(`Dialect.error_texts`), so the scan cannot drift from them. What must stay is in `ALLOWED` with
the reason, and an entry that no longer matches fails, so the list cannot rot.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from store.dialects import registered
from tests.test_architecture import ROOT, imports, module_name, modules

#: Drivers no registered dialect uses yet: a third backend's would be one of these.
OTHER_DRIVERS = (
    "psycopg",
    "psycopg2",
    "pg8000",
    "pymysql",
    "aiomysql",
    "asyncmy",
    "MySQLdb",
    "oracledb",
    "cx_Oracle",
    "pyodbc",
    "aioodbc",
    "apsw",
    "pysqlite2",
    "duckdb",
)
#: Attributes only a driver's errors have: asking for one is knowing the driver.
ERROR_ATTRIBUTES = ("sqlstate", "pgcode", "pgerror", "sqlite_errorcode", "sqlite_errorname")
#: What code outside `store/dialects/` may import of it: the registry and the questions.
SHARED_DIALECT_MODULES = ("store.dialects", "store.dialects.base")
#: SQLSTATE codes and classes (SQL standard and PostgreSQL: the class is a digit and a character,
#: or one of F0, HV, P0, XX), so "INT32" or "TABLE" is no code.
_CLASS = r"(?:[0-9][0-9A-Z]|F0|HV|P0|XX)"
SQLSTATE = re.compile(rf"{_CLASS}[0-9A-Z]{{3}}")
SQLSTATE_CLASS = re.compile(_CLASS)

#: (file, what it holds) -> why it stays outside `store/dialects/` for now.
ALLOWED: dict[tuple[str, str], str] = {
    ("store/schema/ledger_file.py", "sqlite3"): (
        "`require_ledger` and `holds_ledger` look at a SQLite file with sqlite3 itself, read-only "
        "and before any engine exists, so a mistyped path is never created; SQLite's by job, it "
        "is the next to move behind the dialect (a `Dialect.local_file` companion)"
    ),
    ("store/reads/console.py", "readonly"): (
        "the `sql` verb tells a refused write and a stopped statement by the drivers' texts "
        "('readonly', 'read-only', 'interrupted', 'canceling statement'); the dialect's read-only "
        "guard (`start_read_only`) should answer them, the next to move"
    ),
}


@dataclass(frozen=True)
class Finding:
    where: str
    line: int
    what: str  # the driver module, code, attribute or text found
    kind: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.kind} {self.what!r}"


def _backend_dialect_modules() -> frozenset[str]:
    """`store.dialects.sqlite`, `store.dialects.postgresql`, …: every module of the folder but
    the shared ones."""
    return frozenset(module_name(path) for path in modules("store/dialects")) - frozenset(
        SHARED_DIALECT_MODULES
    )


def drivers() -> frozenset[str]:
    return frozenset(m for d in registered() for m in d.driver_modules) | frozenset(OTHER_DRIVERS)


def error_texts() -> frozenset[str]:
    return frozenset(text for d in registered() for text in d.error_texts())


def _driver_named(value: str, names: frozenset[str]) -> str | None:
    top = value.split(".")[0]
    return top if top in names and re.fullmatch(r"[\w.]+", value) else None


def _is_class(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and SQLSTATE_CLASS.fullmatch(node.value) is not None
    )


def _is_code(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and SQLSTATE.fullmatch(node.value) is not None
    )


def _classes_as_prefixes(tree: ast.AST) -> list[ast.Constant]:
    """Two-character literals used as a SQLSTATE's class: beside codes in one table, as a
    `startswith` argument, or compared with a slice (`state[:2] == "08"`)."""
    found: list[ast.Constant] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            elements = [k for k in node.keys if k is not None]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elements = list(node.elts)
        else:
            elements = []
        if any(_is_code(e) for e in elements):
            found += [e for e in elements if _is_class(e)]  # type: ignore[misc]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "startswith"
        ):
            found += [a for a in node.args if _is_class(a)]  # type: ignore[misc]
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Subscript) and isinstance(s.slice, ast.Slice) for s in sides):
                found += [s for s in sides if _is_class(s)]  # type: ignore[misc]
    return found


def backend_knowledge(
    path: Path,
    root: Path = ROOT,
    names: frozenset[str] | None = None,
    texts: frozenset[str] | None = None,
) -> list[Finding]:
    """Every piece of a driver's knowledge in the file (see the module's docstring)."""
    names = drivers() if names is None else names
    texts = error_texts() if texts is None else texts
    where = str(path.relative_to(root))
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
    found = [
        Finding(where, i.line, i.module.split(".")[0], "imports driver")
        for i in imports(path, root)
        if i.module.split(".")[0] in names
    ]
    found += [
        Finding(where, i.line, module, "imports a backend's dialect")
        for i in imports(path, root)
        for module in (i.module, *(f"{i.module}.{name}" for name in i.names))
        if module in _backend_dialect_modules()
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            found.append(Finding(where, node.lineno, node.id, "uses driver"))
        elif isinstance(node, ast.Attribute) and node.attr in ERROR_ATTRIBUTES:
            found.append(Finding(where, node.lineno, node.attr, "reads driver error attribute"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if (driver := _driver_named(value, names)) is not None:
                found.append(Finding(where, node.lineno, driver, "names driver"))
            elif SQLSTATE.fullmatch(value):
                found.append(Finding(where, node.lineno, value, "SQLSTATE"))
            elif value in ERROR_ATTRIBUTES:
                found.append(Finding(where, node.lineno, value, "names driver error attribute"))
            elif value.strip().lower() in texts:
                found.append(Finding(where, node.lineno, value.strip().lower(), "driver text"))
    found += [
        Finding(where, c.lineno, c.value, "SQLSTATE class") for c in _classes_as_prefixes(tree)
    ]
    return sorted(found, key=lambda f: (f.line, f.kind, f.what))


def outside_the_dialects() -> list[Path]:
    return [
        path
        for package in ("sessions", "store")
        for path in modules(package)
        if not module_name(path).startswith("store.dialects")
    ]


def test_no_backend_knowledge_outside_store_dialects() -> None:
    found = [
        str(finding)
        for path in outside_the_dialects()
        for finding in backend_knowledge(path)
        if (finding.where, finding.what) not in ALLOWED
    ]
    assert found == [], (
        "a driver's knowledge outside store/dialects/: ask the backend's Dialect (store.dialects, "
        "or a name store exports) instead, or add an entry to ALLOWED with the reason:\n"
        + "\n".join(found)
    )


def test_every_allowance_still_matches_something() -> None:
    matched = {
        (finding.where, finding.what)
        for path in outside_the_dialects()
        for finding in backend_knowledge(path)
    }
    stale = sorted(key for key in ALLOWED if key not in matched)
    assert stale == [], f"ALLOWED entries that match nothing any more (drop them): {stale}"


# ------------------------------------------------------------------ the scanner itself
def test_the_dialects_declare_what_the_scan_looks_for() -> None:
    """Each dialect names its driver and its texts, and every SQLSTATE it declares is one the
    scan's patterns recognise: a code the scan could not see could leak out unnoticed."""
    for dialect in registered():
        assert dialect.driver_modules, dialect
        assert all(t and t == t.lower() for t in dialect.error_texts()), dialect
        for state in dialect.sqlstate_hints:
            assert SQLSTATE.fullmatch(state) or SQLSTATE_CLASS.fullmatch(state), state
    assert {"sqlite3", "aiosqlite", "asyncpg"} <= drivers()
    assert {"database is locked", "terminating connection", "disk is full"} <= error_texts()


def test_the_scan_finds_the_dialects_own_knowledge() -> None:
    """Pointed at the dialects' modules, the scan finds what they hold on purpose."""
    found = {
        (f.what, f.kind)
        for path in sorted((ROOT / "store" / "dialects").glob("*.py"))
        for f in backend_knowledge(path)
    }
    assert ("sqlite3", "imports driver") in found
    assert ("asyncpg", "names driver") in found
    assert ("28P01", "SQLSTATE") in found and ("08", "SQLSTATE class") in found
    assert ("sqlstate", "names driver error attribute") in found
    assert ("database is locked", "driver text") in found


def test_the_scan_sees_each_form(tmp_path: Path) -> None:
    sample = tmp_path / "store" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        '"""A docstring may say asyncpg and database is locked."""\n'  # 1: prose, not knowledge
        "import sqlite3\n"  # 2
        "from psycopg import errors\n"  # 3
        "def f(error, text):\n"  # 4
        "    import asyncpg.exceptions\n"  # 5
        "    if type(error).__module__ == 'asyncpg':\n"  # 6
        "        return sqlite3.Error\n"  # 7
        "    if error.sqlstate in ('40001', '57P01'):\n"  # 8
        "        return getattr(error, 'pgcode', '')\n"  # 9
        "    if 'database is locked' in text.lower():\n"  # 10
        "        return {'3D000': 'a', '08': 'b'}\n"  # 11
        "    if error.code.startswith('57') or error.code[:2] == '53':\n"  # 12
        "        return 'INT32', 'TABLE', '08', 'sqlite+aiosqlite:///x.db'\n"  # 13: none of these
        "    return importlib.import_module('aiosqlite')\n"  # 14
        "from store.dialects import postgresql as pg, dialect_of\n"  # 15: the module, not the name
        "from store.dialects.base import Row\n"  # 16: the questions are shared
        "import store.dialects.sqlite_engine\n",  # 17
        encoding="utf-8",
    )
    got = [
        (f.line, f.kind, f.what)
        for f in backend_knowledge(
            sample,
            tmp_path,
            names=frozenset({"sqlite3", "psycopg", "asyncpg", "aiosqlite"}),
            texts=frozenset({"database is locked"}),
        )
    ]
    assert got == [
        (2, "imports driver", "sqlite3"),
        (3, "imports driver", "psycopg"),
        (5, "imports driver", "asyncpg"),
        (6, "names driver", "asyncpg"),
        (7, "uses driver", "sqlite3"),
        (8, "SQLSTATE", "40001"),
        (8, "SQLSTATE", "57P01"),
        (8, "reads driver error attribute", "sqlstate"),
        (9, "names driver error attribute", "pgcode"),
        (10, "driver text", "database is locked"),
        (11, "SQLSTATE", "3D000"),
        (11, "SQLSTATE class", "08"),
        (12, "SQLSTATE class", "53"),
        (12, "SQLSTATE class", "57"),
        (14, "imports driver", "aiosqlite"),
        (14, "names driver", "aiosqlite"),
        (15, "imports a backend's dialect", "store.dialects.postgresql"),
        (17, "imports a backend's dialect", "store.dialects.sqlite_engine"),
    ], got
