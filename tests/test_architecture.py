"""The layout's rules (docs/design.md §10), checked on the source itself.

- `store` never imports `sessions`; `sessions` reaches `store` only through the names
  `store.__all__` exports (`import store`, `from store import X`), never through a submodule.
  Every import form counts: module level, function-local, under `TYPE_CHECKING`, relative, and
  `importlib.import_module` / `__import__` with a literal name.
- The public surface of `sessions` is frozen here: changing it is a deliberate edit of this file.
- No module of `sessions/` or `store/` grows past 600 lines.
- No code outside `store/dialects/` branches on a backend's name (`== "postgresql"`,
  `.startswith("sqlite")`, …): it asks the backend's `Dialect` object.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Import:
    """One import in a module: the absolute module it names and, for `from M import a, b`, the names."""

    where: str  # the file, relative to the project root
    line: int
    module: str
    names: tuple[str, ...]  # () for `import M`
    text: str  # the import as written (its first line), for the report

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.text}"


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(path: Path, root: Path, level: int, module: str | None) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if level == 0:
        return module or ""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]  # a module's relative imports start from its package
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in the file, wherever it sits (ast.walk visits function bodies too)."""
    source = path.read_text(encoding="utf-8")
    where = str(path.relative_to(root))
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, ast.Import):
            found += [
                Import(where, node.lineno, alias.name, (), _text(source, node))
                for alias in node.names
            ]
        elif isinstance(node, ast.ImportFrom):
            found.append(
                Import(
                    where,
                    node.lineno,
                    _absolute(path, root, node.level, node.module),
                    tuple(alias.name for alias in node.names),
                    _text(source, node),
                )
            )
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(Import(where, node.lineno, first.value, (), _text(source, node)))
    return found


def _text(source: str, node: ast.AST) -> str:
    return (ast.get_source_segment(source, node) or "").splitlines()[0]


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _store_aliases(path: Path) -> set[str]:
    """Names the module binds to the `store` package itself (`import store`, `import store as s`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "store"
    }


def _store_attributes(path: Path, exported: set[str], root: Path = ROOT) -> list[str]:
    """`store.X` with X not exported, reached through the package bound by `import store`."""
    aliases = _store_aliases(path)
    if not aliases:
        return []
    source = path.read_text(encoding="utf-8")
    return [
        f"{path.relative_to(root)}:{node.lineno}: {_text(source, node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr not in exported
    ]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def store_violations() -> list[str]:
    return [
        str(i) for path in modules("store") for i in imports(path) if _within(i.module, "sessions")
    ]


def sessions_violations(exported: set[str]) -> list[str]:
    found = []
    for path in modules("sessions"):
        for i in imports(path):
            if not _within(i.module, "store"):
                continue
            allowed = i.module == "store" and all(
                name == "*" or name in exported for name in i.names
            )
            if not allowed:
                found.append(str(i))
        found += _store_attributes(path, exported)
    return found


def test_store_never_imports_sessions() -> None:
    violations = store_violations()
    assert not violations, (
        "store/ imports sessions (docs/design.md §10: store never imports sessions):\n"
        + "\n".join(violations)
    )


def test_sessions_imports_from_store_only_what_store_exports() -> None:
    import store

    exported = set(store.__all__)
    assert all(hasattr(store, name) for name in exported), (
        "store.__all__ names something store does not have"
    )
    violations = sessions_violations(exported)
    assert not violations, (
        "sessions/ reaches into store/ past store.__all__ (import only `store` or `from store import X`, "
        "X in store.__all__):\n" + "\n".join(violations)
    )


# ------------------------------------------------------------------ the checker itself
def test_the_import_checker_sees_every_form(tmp_path: Path) -> None:
    """The rules above are only as good as the parser: each form must be found and resolved."""
    path = tmp_path / "sessions" / "sub" / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(
        "\n".join(
            [
                "import store.tables",
                "from store import read_models, tables",
                "from store.read_models import metric_rows",
                "def f():",
                "    from store import bulk_copy as b",
                "    import importlib",
                "    return importlib.import_module('store.views')",
                "if TYPE_CHECKING:",
                "    from store.records import StoredEvent",
                "from . import sibling",
                "from ..other import thing",
                "__import__('store.engine')",
            ]
        ),
        encoding="utf-8",
    )
    found = imports(path, tmp_path)
    got = {(i.line, i.module, i.names) for i in found}
    assert got == {
        (1, "store.tables", ()),
        (2, "store", ("read_models", "tables")),
        (3, "store.read_models", ("metric_rows",)),
        (5, "store", ("bulk_copy",)),
        (6, "importlib", ()),
        (7, "store.views", ()),
        (9, "store.records", ("StoredEvent",)),
        (10, "sessions.sub", ("sibling",)),
        (11, "sessions.other", ("thing",)),
        (12, "store.engine", ()),
    }
    assert (
        str(next(i for i in found if i.line == 3))
        == "sessions/sub/mod.py:3: from store.read_models import metric_rows"
    )


def test_the_checker_sees_a_submodule_reached_through_the_package(tmp_path: Path) -> None:
    path = tmp_path / "sessions" / "mod.py"
    path.parent.mkdir()
    path.write_text(
        "import store as st\n\ndef f():\n    return st.tables.events, st.create_engine\n",
        encoding="utf-8",
    )
    assert _store_attributes(path, {"create_engine"}, tmp_path) == ["sessions/mod.py:4: st.tables"]


# ------------------------------------------------------------------ the public surface
PUBLIC = [
    "AppendOutcomeUnknown",
    "BatchPruned",
    "BatchRow",
    "BatchTooLongError",
    "CircuitBreaker",
    "ConcurrencyError",
    "ConfigError",
    "DEFAULT_RUN",
    "DamagedData",
    "ExportError",
    "ExportSummary",
    "InProcessQueue",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidInput",
    "InvalidTransition",
    "Ledger",
    "LedgerClosed",
    "LedgerConfig",
    "LedgerError",
    "LedgerTimeout",
    "LoggedStep",
    "MetricPolicy",
    "MetricRow",
    "MissingDependency",
    "NotFound",
    "PlaceholderPolicy",
    "ProjectionError",
    "Projector",
    "PruneReport",
    "QueueConsumer",
    "QueueItem",
    "QueueSink",
    "RetentionPolicy",
    "RetryPolicy",
    "RolloutFailure",
    "RowIndexError",
    "RunConfigMismatch",
    "RunHalted",
    "SandboxError",
    "SchemaError",
    "ServerConnectionError",
    "SessionHandle",
    "SessionOutcome",
    "SessionProxy",
    "StepNotSettled",
    "StepPrunedError",
    "StoreError",
    "SyncLedger",
    "SyncSession",
    "TensorBoardTracker",
    "TransferQueueSink",
    "UnknownEventError",
    "UsageError",
    "WandbTracker",
    "build_jagged",
    "build_padded",
    "concat_batches",
    "densify",
    "export_dataset",
    "grpo_outcome_advantage",
    "log_step",
    "log_step_sync",
    "pad_to_widths",
    "prune",
    "select_rows",
    "split_batch",
    "start_transferqueue",
    "to_data_proto",
    "to_plain_dict",
]


def test_public_surface_is_frozen() -> None:
    import sessions

    assert PUBLIC == sorted(PUBLIC), "keep the frozen list sorted"
    assert len(sessions.__all__) == len(set(sessions.__all__)), "sessions.__all__ repeats a name"
    assert sorted(sessions.__all__) == PUBLIC, (
        "the public API changed: if on purpose, edit PUBLIC in this test"
    )


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_importable(name: str) -> None:
    import sessions

    assert getattr(sessions, name) is not None


def _documented_modules() -> set[str]:
    """The module paths docs/architecture.md names: `name.py` cells under each package's heading."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    named: set[str] = set()
    package = None
    for line in text.splitlines():
        heading = re.match(r"### `([\w/]+)/`", line)
        if heading:  # the module tables of sessions/ and store/ (migrations/ has its own test)
            package = (
                heading.group(1)
                if heading.group(1).split("/")[0] in ("sessions", "store")
                else None
            )
            continue
        if package and line.startswith("| `"):
            cell = line.split("|")[1]
            for name in re.findall(r"`([\w/]+\.py)`", cell):
                named.add(f"{package}/{name}")
    return named


def test_the_architecture_map_names_every_module_and_no_missing_one() -> None:
    """docs/architecture.md is a newcomer's first page: it must match the tree."""
    tree = {str(p.relative_to(ROOT)) for package in ("sessions", "store") for p in modules(package)}
    documented = _documented_modules()
    assert documented, "no module tables found in docs/architecture.md"
    assert sorted(tree - documented) == [], "modules docs/architecture.md does not name"
    assert sorted(documented - tree) == [], "modules docs/architecture.md names that are gone"


def test_the_architecture_map_lists_every_migration_and_the_rooms_in_their_order() -> None:
    """The page's prose is checked against the tree where a test can do it: the revision table
    names every revision file, and the room table lists LAYERS' rooms in LAYERS' order."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    revisions = {p.name for p in (ROOT / "migrations" / "versions").glob("0*.py")}
    assert set(re.findall(r"`versions/(0\w+\.py)`", text)) == revisions
    rooms = re.findall(r"^\| `(sessions/\w+)/` \|", text, flags=re.MULTILINE)
    assert [r.replace("/", ".") for r in rooms] == [room for room, _why in LAYERS[1:]]


# --- The rules docs/architecture.md states: each one a test -------------------------------------

#: The rooms of `sessions/`, lowest first: a module may import its own room and the rooms below,
#: never one above. Each room is here because of what it needs from the rooms below it:
LAYERS: list[tuple[str, str]] = [
    ("sessions", "the domain: events, the state machine, the recorder, names, validation"),
    (
        "sessions.runs",
        "a run's own records (fingerprint, retention, prunes); its jobs take LedgerParts",
    ),
    ("sessions.batches", "rows into verl-convention torch batches"),
    ("sessions.queues", "the sinks and the durable queue carry batch rows"),
    ("sessions.projection", "the rules fill queues with batch rows and check a step's prunes"),
    ("sessions.audit", "replay and audit rebuild the log with the projection's rules"),
    ("sessions.ledger", "the facade drives every room below it"),
    ("sessions.export", "datasets out, through the ledger's reads"),
    ("sessions.report", "the report writes its folder as export writes its files"),
    (
        "sessions.trackers",
        "a step's metrics through the ledger, its text shown as the report shows it",
    ),
    ("sessions.otel", "sessions as OpenTelemetry traces, read through the ledger"),
    ("sessions.gateway", "an OpenAI-compatible endpoint records calls through the ledger"),
    ("sessions.integrations", "verl, TRL and TransferQueue drive the ledger"),
    ("sessions.cli", "every verb"),
]
#: `sessions/__init__.py`: the public face, above every room (it only names them, lazily).
FACE = "sessions"
#: Import circles left in `sessions/` on purpose: (module, module) -> why (none today).
CIRCLES_KEPT: dict[tuple[str, ...], str] = {}


def layer_of(module: str) -> int:
    """The index in LAYERS of the room `module` is in (the domain for the top of `sessions/`)."""
    for depth in range(len(LAYERS) - 1, 0, -1):
        room = LAYERS[depth][0]
        if _within(module, room):
            return depth
    return 0


def _lazy_names(package: str, root: Path = ROOT) -> dict[str, str]:
    """A package's lazy name table (name -> defining module), read from its `__init__.py`: the
    module-level dict literal of names to module paths (nothing is imported)."""
    init = root.joinpath(*package.split("."), "__init__.py")
    if not init.exists():
        return {}
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if (
            isinstance(value, ast.Dict)
            and value.keys
            and all(
                isinstance(k, ast.Constant)
                and isinstance(v, ast.Constant)
                and isinstance(v.value, str)
                for k, v in zip(value.keys, value.values)
            )
        ):
            return {k.value: v.value for k, v in zip(value.keys, value.values)}  # type: ignore[union-attr]
    return {}


def _is_module(name: str, root: Path = ROOT) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def sessions_edges(root: Path = ROOT) -> dict[str, set[tuple[str, Import]]]:
    """module -> {(the module it really loads, the import)} for every import inside `sessions/`.

    `from P import N` is P.N when that is a module, else the module P's lazy table loads N from
    (`from sessions import Ledger` is an import of `sessions.ledger.ledger`), else P itself.
    """
    edges: dict[str, set[tuple[str, Import]]] = {}
    for path in sorted((root / "sessions").rglob("*.py")):
        me = module_name(path, root)
        found: set[tuple[str, Import]] = set()
        for i in imports(path, root):
            if not _within(i.module, "sessions"):
                continue
            if not i.names:
                found.add((i.module, i))
                continue
            table = _lazy_names(i.module, root)
            for name in i.names:
                if _is_module(f"{i.module}.{name}", root):
                    found.add((f"{i.module}.{name}", i))
                else:
                    found.add((table.get(name, i.module), i))
        edges[me] = {(target, i) for target, i in found if target != me}
    return edges


def test_no_module_of_sessions_imports_a_room_above_its_own() -> None:
    upward = sorted(
        f"{i} -> {target} ({LAYERS[layer_of(target)][0]} is above {LAYERS[layer_of(me)][0]})"
        for me, found in sessions_edges().items()
        if me != FACE
        for target, i in found
        if layer_of(target) > layer_of(me)
    )
    assert upward == [], "an import climbs a room (see LAYERS): move the code down, or invert it"


def test_every_room_of_sessions_is_in_the_layers() -> None:
    """A new subpackage is placed in LAYERS deliberately, never silently in the domain."""
    rooms = {
        f"sessions.{p.name}" for p in (ROOT / "sessions").iterdir() if (p / "__init__.py").exists()
    }
    assert rooms == {room for room, _why in LAYERS[1:]}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary circle's strongly connected component, as sorted module lists (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_sessions_has_no_import_circle() -> None:
    """Every import form counts (function-local, TYPE_CHECKING): a circle is a knot a reader must
    hold in mind at once, wherever Python happens to tolerate it."""
    graph = {
        me: {target for target, _i in found} for me, found in sessions_edges().items() if me != FACE
    }
    left = [c for c in circles(graph) if tuple(c) not in CIRCLES_KEPT]
    assert left == [], (
        "import circles in sessions/ (break them, or name them in CIRCLES_KEPT with why)"
    )
    assert all(list(kept) in circles(graph) for kept in CIRCLES_KEPT), "drop circles that are gone"


def test_the_circle_finder_finds_each_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]


def test_the_edges_resolve_a_name_through_the_lazy_table(tmp_path: Path) -> None:
    """`from sessions import Ledger` is an edge to the module that defines Ledger, not to the face;
    `from sessions import events` to the submodule; a relative import to its absolute module."""
    package = tmp_path / "sessions"
    (package / "ledger").mkdir(parents=True)
    (package / "__init__.py").write_text('_NAMES = {"Ledger": "sessions.ledger.ledger"}\n')
    (package / "events.py").write_text("")
    (package / "ledger" / "__init__.py").write_text("")
    (package / "ledger" / "ledger.py").write_text("from sessions import events\n")
    (package / "cli.py").write_text(
        "from sessions import Ledger, events\ndef f():\n    from .ledger import ledger\n"
    )
    edges = {me: sorted({t for t, _i in found}) for me, found in sessions_edges(tmp_path).items()}
    assert edges["sessions.cli"] == ["sessions.events", "sessions.ledger.ledger"]
    assert edges["sessions.ledger.ledger"] == ["sessions.events"]


def test_no_sessions_module_outside_the_cli_imports_sqlalchemy() -> None:
    found = [
        str(i)
        for path in modules("sessions")
        if not module_name(path).startswith("sessions.cli")
        for i in imports(path)
        if i.module == "sqlalchemy" or i.module.startswith("sqlalchemy.")
    ]
    assert found == [], "SQL lives in store/: ask store for what you need"


_SQL = __import__("re").compile(
    r"\b(SELECT\s+.+\s+FROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s+TABLE)\b",
    __import__("re").IGNORECASE | __import__("re").DOTALL,
)
#: Strings of `sessions/` that are SQL on purpose, with why.
SQL_ALLOWED = {
    "sessions/cli/demo.py": "the demo prints an example `sql` command for the user to run",
}


def test_no_sql_text_in_sessions() -> None:
    found = []
    for path in modules("sessions"):
        where = str(path.relative_to(ROOT))
        if where in SQL_ALLOWED:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and _SQL.search(node.value)
            ):
                found.append(f"{where}:{node.lineno}: {node.value[:60]!r}")
    assert found == [], "SQL text belongs in store/ (a function there, called from here)"
    assert all((ROOT / name).exists() for name in SQL_ALLOWED), "drop allowances for gone files"


def test_store_has_no_import_circle() -> None:
    graph: dict[str, set[str]] = {}
    for path in modules("store"):
        me = module_name(path)
        graph[me] = {
            i.module for i in imports(path) if i.module.startswith("store.") and i.module != me
        }
    seen: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                return [*trail, node, nxt]
            if nxt not in seen and (cycle := visit(nxt, [*trail, node])):
                return cycle
        seen[node] = 2
        return None

    for start in sorted(graph):
        if start not in seen and (cycle := visit(start, [])):
            pytest.fail(f"import circle in store/: {' -> '.join(cycle)}")


# ------------------------------------------------------------------ dialect branches
#: The backends' names as SQLAlchemy spells them (`engine.dialect.name`, a URL's drivername).
BACKEND_NAMES = ("sqlite", "postgresql", "postgres")


def _names_a_backend(node: ast.AST) -> bool:
    """A string literal naming a backend ("sqlite", "postgresql+asyncpg", …), or a tuple/list/set
    of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_backend(element) for element in node.elts)
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.split("+", 1)[0].split(":", 1)[0] in BACKEND_NAMES
    )


def backend_branches(path: Path, root: Path = ROOT) -> list[str]:
    """Every place in the file that tests which backend it is on: a comparison with a backend's
    name (`==`, `!=`, `in`), a `startswith`/`endswith` of one, or a `match` case on one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            hit = any(_names_a_backend(side) for side in (node.left, *node.comparators))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = node.func.attr in ("startswith", "endswith") and any(
                _names_a_backend(arg) for arg in node.args
            )
        elif isinstance(node, ast.MatchValue):
            hit = _names_a_backend(node.value)
        else:
            continue
        if hit:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_code_outside_store_dialects_branches_on_a_backends_name() -> None:
    """docs/architecture.md: every dialect branch lives in `store/dialects/`; code elsewhere
    asks the backend's `Dialect` object a question (a capability, a statement, a method)."""
    found = [
        branch
        for package in ("sessions", "store")
        for path in modules(package)
        if not module_name(path).startswith("store.dialects")
        for branch in backend_branches(path)
    ]
    assert found == [], "ask the backend's Dialect (store/dialects/) instead of testing its name"


def test_the_branch_scan_sees_each_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "a = engine.dialect.name == 'postgresql'\n"
        "b = url.startswith('sqlite+aiosqlite')\n"
        "c = name in ('sqlite', 'mysql')\n"
        "match backend:\n"
        "    case 'postgres':\n"
        "        pass\n"
        "d = name == 'sqlite_sequence'\n"  # a table of SQLite's, not a backend test
        "e = kind == 'sqlitefile'\n",
        encoding="utf-8",
    )
    lines = [branch.split(":")[1] for branch in backend_branches(sample, tmp_path)]
    assert lines == ["1", "2", "3", "5"], lines
