"""Typed stubs (`.pyi`) for what is built at run time, generated from it so nothing is written twice:
the faces `sessions.ledger.sync.faces` derives from `Ledger` and `SessionHandle`, and the names
`sessions` and `sessions.ledger` load on first use (their `_NAMES` tables, `sessions.lazy`).

An editor or a type checker reads a `.pyi` beside a module instead of the module. Write them with

    python -m sessions.ledger.stubgen          # --check: exit 1, writing nothing, if one is stale

`tests/ledger/test_stubs.py` regenerates each in memory and compares it with the committed file.
The text comes out as `ruff format` and ruff's import sorting leave it (a trailing comma keeps a
wrapped list one item a line).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import importlib
import inspect
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from sessions.errors import InvalidArgument

__all__ = ["STUBS", "Imports", "class_stub", "main"]

ROOT = Path(__file__).resolve().parents[2]
_WIDTH = 100  # pyproject.toml's line-length
_FIRST_PARTY = {
    "sessions",
    "store",
    "migrations",
    "benchmarks",
    "tests",
}  # ruff's known-first-party
#: Dunder methods a stub keeps (what `with`, `async with` and construction need).
PROTOCOL = ("__init__", "__enter__", "__exit__", "__aenter__", "__aexit__")


def _header(source: str) -> str:
    return (
        f"# Generated from {source} by `python -m sessions.ledger.stubgen`: edit that, not this.\n"
    )


# ------------------------------------------------------------------------- where a name comes from
@dataclass
class Imports:
    """The names a stub's annotations use, each imported as the module that uses it imports it."""

    #: Modules whose imports and definitions a name is looked up in, first first.
    modules: list[ModuleType]
    #: Names the stub defines itself (its classes, its type variables).
    local: set[str] = field(default_factory=set)
    #: Each imported name -> (module, member or None for the module itself, alias or None).
    used: dict[str, tuple[str, str | None, str | None]] = field(default_factory=dict)
    #: Every name an annotation used, the stub's own too.
    named: set[str] = field(default_factory=set)

    def use(self, annotation: str, *, where: Iterable[ModuleType] = ()) -> str:
        """Note each name `annotation` uses (looked up first in `where`); give it back."""
        for node in ast.walk(ast.parse(annotation, mode="eval")):
            if isinstance(node, ast.Name):
                self.named.add(node.id)
                if node.id not in self.local | self.used.keys() and not hasattr(builtins, node.id):
                    self.used[node.id] = self._find(node.id, [*where, *self.modules])
        return annotation

    def _find(self, name: str, modules: list[ModuleType]) -> tuple[str, str | None, str | None]:
        for module in modules:
            found = _bindings(module).get(name)
            if found is not None:
                return found
        raise InvalidArgument(
            f"stubgen: no module among {list(dict.fromkeys(m.__name__ for m in modules))} imports or defines {name!r}, "
            "which an annotation names; import it there (under TYPE_CHECKING if only for typing)"
        )

    def lines(self) -> list[str]:
        """The import statements, in ruff's (isort's) sections and order."""
        sections: dict[int, list[tuple[tuple[Any, ...], str]]] = {}
        froms: dict[str, list[str]] = {}
        for module, member, alias in self.used.values():
            if member is None:
                statement = f"import {module}" + (f" as {alias}" if alias else "")
                sections.setdefault(_section(module), []).append(((0, module.lower()), statement))
            elif alias:
                statement = f"from {module} import {member} as {alias}"
                sections.setdefault(_section(module), []).append(((1, module.lower()), statement))
            else:
                froms.setdefault(module, []).append(member)
        for module, members in froms.items():
            names = sorted(set(members), key=_member_key)
            statement = _wrapped(f"from {module} import ", names, "", "", inline=False)
            sections.setdefault(_section(module), []).append(((1, module.lower()), statement))
        return [
            "\n".join(statement for _, statement in sorted(sections[kind]))
            for kind in sorted(sections)
        ]


@functools.cache
def _bindings(module: ModuleType) -> dict[str, tuple[str, str | None, str | None]]:
    """What each name at the top of `module` (and under its `if TYPE_CHECKING:`) is: (module,
    member or None for a module, alias)."""
    tree = ast.parse(inspect.getsource(module))
    found: dict[str, tuple[str, str | None, str | None]] = {}
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, ast.If):
            statements[:0] = node.body
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found[alias.asname or alias.name.split(".")[0]] = (alias.name, None, alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                found[alias.asname or alias.name] = (node.module, alias.name, alias.asname)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = (module.__name__, node.name, None)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = (module.__name__, target.id, None)
    return found


def _section(module: str) -> int:
    top = module.split(".")[0]
    return 0 if top in sys.stdlib_module_names else 2 if top in _FIRST_PARTY else 1


def _member_key(name: str) -> tuple[int, str]:
    """isort's order within `from m import ...`: constants, then classes, then the rest."""
    kind = 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name.lower()


# ------------------------------------------------------------------------------------- text
def _wrapped(
    start: str,
    items: list[str],
    end: str,
    indent: str,
    *,
    brackets: tuple[str, str] = ("(", ")"),
    inline: bool = True,
) -> str:
    """`start(item, item)end` on one line if it fits (`inline=False`: no brackets there), else
    one item a line with a trailing comma, which keeps ruff from joining them again."""
    opening, closing = brackets if inline else ("", "")
    line = f"{indent}{start}{opening}{', '.join(items)}{closing}{end}"
    if len(line) <= _WIDTH:
        return line
    inner = "".join(f"{indent}    {item},\n" for item in items)
    return f"{indent}{start}{brackets[0]}\n{inner}{indent}{brackets[1]}{end}"


def _docstring(doc: str | None, indent: str) -> str | None:
    """`doc` as a docstring at `indent`, written so that it reads back as the same text."""
    if not doc:
        return None
    text = inspect.cleandoc(doc).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    text = text[:-1] + '\\"' if text.endswith('"') else text
    first, *rest = text.split("\n")
    lines = "".join(f"\n{indent}{line}" if line else "\n" for line in rest)
    return f'{indent}"""{first}{lines}"""'


def _literal(value: Any) -> str:
    """A default as the stub writes it: a plain literal as itself, anything else `...`."""
    if (
        value is None
        or isinstance(value, int)
        or (isinstance(value, float) and math.isfinite(value))
    ):
        return repr(value)
    if isinstance(value, str) and "\\" not in value and '"' not in value:
        return f'"{value}"'
    return "..."


def _parameters(
    signature: inspect.Signature, imports: Imports, where: list[ModuleType]
) -> list[str]:
    """Each parameter as the stub writes it, with the `/` and `*` markers between them."""
    out: list[str] = []
    parameters = list(signature.parameters.values())
    starred = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    for index, parameter in enumerate(parameters):
        kind = parameter.kind
        if kind is parameter.KEYWORD_ONLY and not starred:
            out.append("*")
            starred = True
        stars = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(kind.name, "")
        text = stars + parameter.name
        if parameter.annotation is not parameter.empty:
            text += f": {imports.use(_annotation(parameter.annotation), where=where)}"
        if parameter.default is not parameter.empty:
            equals = " = " if parameter.annotation is not parameter.empty else "="
            text += equals + _literal(parameter.default)
        out.append(text)
        following = parameters[index + 1].kind if index + 1 < len(parameters) else None
        if kind is parameter.POSITIONAL_ONLY and following is not parameter.POSITIONAL_ONLY:
            out.append("/")
    return out


def _annotation(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _function(name: str, function: Any, imports: Imports, indent: str, owner: type | None) -> str:
    """A `def` (or `async def`) with its decorators, signature and docstring."""
    decorators: list[str] = []
    if isinstance(function, property):
        decorators, function = ["property"], function.fget
    elif isinstance(function, (classmethod, staticmethod)):
        decorators, function = [type(function).__name__], function.__func__
    inner = getattr(function, "__wrapped__", None)
    if inspect.isgeneratorfunction(inner) or inspect.isasyncgenfunction(inner):
        prefix = "async" if inspect.isasyncgenfunction(inner) else ""
        imports.used["contextlib"] = ("contextlib", None, None)
        decorators.append(f"contextlib.{prefix}contextmanager")
    original = inspect.unwrap(function)
    where = [sys.modules[original.__module__]]
    if owner is not None:  # then the modules of the class and its bases, for what they annotate
        where += [sys.modules[klass.__module__] for klass in owner.__mro__[:-1]]
    signature = inspect.signature(function)
    keyword = "async def" if inspect.iscoroutinefunction(function) else "def"
    returns = ""
    if signature.return_annotation is not signature.empty:
        returns = f" -> {imports.use(_annotation(signature.return_annotation), where=where)}"
    doc = _docstring(function.__doc__, indent + "    ")
    tail = f"{returns}:" + ("" if doc else " ...")
    parameters = _parameters(signature, imports, where)
    text = _wrapped(f"{keyword} {name}", parameters, tail, indent)
    lines = [f"{indent}@{decorator}" for decorator in decorators] + [text]
    return "\n".join(lines + ([doc] if doc else []))


def class_stub(cls: type, imports: Imports) -> str:
    """The class with every public member and protocol method of it and its bases, flattened."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        members.update(
            (name, member)
            for name, member in vars(klass).items()
            if (not name.startswith("_") or name in PROTOCOL)
            and (callable(member) or isinstance(member, (property, classmethod, staticmethod)))
        )
    imports.local.add(cls.__name__)
    body = [_docstring(cls.__doc__, "    ")] if cls.__doc__ else []
    body += [_function(name, member, imports, "    ", cls) for name, member in members.items()]
    return f"class {cls.__name__}:\n" + ("\n".join(filter(None, body)) or "    ...")


def _module_stub(name: str) -> str:
    """A module's stub: its docstring, `__all__`, and each name of `__all__` (classes, functions,
    annotated constants), with the imports and type variables their annotations need."""
    module = importlib.import_module(name)
    imports = Imports([module])
    type_variables = {key: v for key, v in vars(module).items() if isinstance(v, TypeVar)}
    imports.local.update(module.__all__, type_variables)
    blocks: list[str] = []
    for key in module.__all__:
        value = getattr(module, key)
        if isinstance(value, type):
            blocks.append(class_stub(value, imports))
        elif callable(value):
            blocks.append(_function(key, value, imports, "", None))
        else:
            blocks.append(f"{key}: {imports.use(module.__annotations__[key])}")
    declared = [
        f'{key} = TypeVar("{key}"' + (f", bound={v.__bound__.__name__})" if v.__bound__ else ")")
        for key, v in type_variables.items()
        if key in imports.named
    ]
    if declared:
        imports.used["TypeVar"] = ("typing", "TypeVar", None)
    path = name.replace(".", "/") + ".py"
    return _join(path, module.__doc__, imports, module.__all__, declared, blocks)


def _lazy_stub(package: str) -> str:
    """A lazy package's stub: each name of its `_NAMES` table imported from where it loads."""
    module = importlib.import_module(package)
    table: dict[str, str] = vars(module)["_NAMES"]
    imports = Imports([])
    imports.used = {name: (source, name, None) for name, source in table.items()}
    path = package.replace(".", "/") + "/__init__.py"
    return _join(path, module.__doc__, imports, module.__all__, [], [])


def _join(
    path: str,
    doc: str | None,
    imports: Imports,
    public: list[str],
    type_variables: list[str],
    blocks: list[str],
) -> str:
    exported = _wrapped("__all__ = ", [f'"{name}"' for name in public], "", "", brackets=("[", "]"))
    parts = [_header(path) + (_docstring(doc, "") or "")] + imports.lines() + [exported]
    parts += ["\n".join(type_variables)] if type_variables else []
    return "\n\n".join(parts + blocks) + "\n"


# ----------------------------------------------------------------------------------- command
#: Each stub's path under the project root -> its text, made now.
STUBS: dict[str, Callable[[], str]] = {
    "sessions/__init__.pyi": lambda: _lazy_stub("sessions"),
    "sessions/ledger/__init__.pyi": lambda: _lazy_stub("sessions.ledger"),
    "sessions/ledger/sync/faces.pyi": lambda: _module_stub("sessions.ledger.sync.faces"),
}


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """Write each stale stub under `root` (`--check`: only name them, and exit 1 if any)."""
    parser = argparse.ArgumentParser(prog="python -m sessions.ledger.stubgen", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if one is stale"
    )
    check = parser.parse_args(argv).check
    stale = []
    for path, make in STUBS.items():
        target, text = root / path, make()
        if target.exists() and target.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not check:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        print(f"{'stale' if check else 'wrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
