"""The public names of `sessions` and `store`: three declarations held to one.

Both packages load their names on first use (PEP 562) from one table (`_NAMES`, `_EXPORTS`).
`__all__` stays a literal list (ruff and type checkers read it statically, so it cannot be
computed from the table), and what an editor sees is an `if TYPE_CHECKING:` block of imports
(in `sessions`, without the names whose modules sit in a layer above the package's root, which
`tests/test_architecture.py` forbids it to import). Held here: `__all__` lists exactly the table's
names, once each; every TYPE_CHECKING import is a table name, from the module the table loads it
from; and every name the table lists loads.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _type_checking_imports(package: str) -> dict[str, str]:
    """name -> the dotted path it is imported from under `if TYPE_CHECKING:` (`module.name`)."""
    tree = ast.parse((ROOT / package / "__init__.py").read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.dump(statement)
                for alias in statement.names:
                    out[alias.asname or alias.name] = f"{statement.module}.{alias.name}"
    return out


def _table(package: str) -> dict[str, str]:
    """name -> the dotted path the lazy table loads it from (`module.attribute` or `module`)."""
    module = importlib.import_module(package)
    if package == "sessions":
        return {name: f"{where}.{name}" for name, where in module._NAMES.items()}
    return {
        name: where if attribute is None else f"{where}.{attribute}"
        for name, (where, attribute) in module._EXPORTS.items()
    }


@pytest.mark.parametrize("package", ["sessions", "store"])
def test_all_and_the_type_checking_imports_agree_with_the_lazy_table(package: str) -> None:
    module = importlib.import_module(package)
    table = _table(package)
    assert len(module.__all__) == len(set(module.__all__)), f"{package}.__all__ repeats a name"
    assert set(module.__all__) == set(table), (
        f"{package}/__init__.py: only in __all__ {sorted(set(module.__all__) - set(table))}, "
        f"only in the lazy table {sorted(set(table) - set(module.__all__))}"
    )
    seen = _type_checking_imports(package)
    assert set(seen) <= set(table), f"not in the lazy table: {sorted(set(seen) - set(table))}"
    differ = {name: (seen[name], table[name]) for name in seen if seen[name] != table[name]}
    assert not differ, f"{package}: imported from elsewhere than the table says: {differ}"


@pytest.mark.parametrize("package", ["sessions", "store"])
def test_every_public_name_loads(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'not_a_public_name'"):
        module.not_a_public_name  # noqa: B018
