"""A package's names loaded on first use (PEP 562), built from one table: name -> module.

A package that hands out names from heavy modules (torch, SQLAlchemy, TRL) keeps its import
cheap by loading each name when it is first asked for. `lazy_names` gives such a package its
`__getattr__`, `__dir__` and `__all__` from the table alone, so a public name is written once;
`python -m sessions.ledger.stubgen` writes the typed `__init__.pyi` editors read from the same
table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    namespace: dict[str, Any],
    table: Mapping[str, str],
    *,
    eager: Iterable[str] = (),
    extra: str | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for the package whose globals are `namespace`.

    `table`: each lazy name -> the module that defines it; `eager`: the names the package imports
    itself, public too. `extra`: the optional extra the lazy modules need, so that an ImportError
    while loading one says which to install (`MissingDependency`).
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ImportError as error:
            if extra is None:
                raise
            from sessions.errors import MissingDependency

            raise MissingDependency(
                f"{package}.{name} needs the optional extra {extra!r} ({error}); install the "
                f"extra: pip install -e '.[{extra}]'"
            ) from error
        namespace[name] = value  # once loaded, a plain module attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__, sorted({*eager, *table})
