"""Each cross-cutting name is spelt once: where it is declared (docs/design.md §2, §5).

Failure origins and failure reasons are declared in `sessions/vocabulary.py`, the placeholder
policy's choices (`emit`, `drop`, `keep_partial`) in `sessions/placeholder.py`, the metric
policy's (`zero`, `exclude`) in `sessions/failure_policy.py`. Every other module of `sessions/`
names them through those declarations, so a renamed or added value cannot leave a stale copy
behind (a comparison that is never true again, a default the checks refuse).

The scan reads the declared values from the modules themselves, then looks for those strings in
the source of `sessions/` where a string acts as a value: a comparison or membership test, a dict
key or value, a default (a parameter's, `.get`'s), an assignment, a return, an argument (keyword,
positional, or in a collection handed on), a fallback (`x or "..."`), a `Literal[...]`, a `match`
case, a `for` loop's iterable. It leaves alone what only mentions a name: docstrings, f-string
text (messages), the name of a variable handed on beside it (`seconds(timeout, "timeout")`, for
the message) and an attribute's name (`getattr(asyncio, "timeout", None)`). What must stay is in
`ALLOWED`, each with why; an entry that matches nothing fails too, so the list cannot rot.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from sessions import failure_policy, placeholder, vocabulary
from tests import REPO

SESSIONS = REPO / "sessions"


def declared() -> dict[str, str]:
    """Every declared value -> the module (relative to the repo) that declares it, read from the
    declarations themselves."""
    owners: dict[str, tuple[object, ...]] = {
        "sessions/vocabulary.py": (
            *vocabulary.ORIGINS,
            *vocabulary.FAILURE_REASONS,
            vocabulary.UNPROJECTABLE,
        ),
        "sessions/placeholder.py": placeholder.DECISIONS,
        "sessions/failure_policy.py": failure_policy.METRIC_DECISIONS,
    }
    values: dict[str, str] = {}
    for module, names in owners.items():
        for value in names:
            assert isinstance(value, str), (module, value)
            assert values.setdefault(value, module) == module, f"{value!r} is declared twice"
    return values


#: (file, value) -> why the literal stays there.
ALLOWED: dict[tuple[str, str], str] = {
    ("sessions/integrations/verl/agent_loop/settings.py", "timeout"): (
        "the `+ledger.timeout` setting's name (seconds per attempt) and its environment variable's "
        "key, which happen to spell the failure reason"
    ),
    ("sessions/gateway/upstream.py", "timeout"): (
        "httpcore's request extension key for a request's timeouts, which happens to spell the "
        "failure reason"
    ),
    ("sessions/gateway/standin.py", "drop"): (
        "the stand-in server's model name that switches on a dropped stream (a test fault), not "
        "the placeholder decision"
    ),
}


@dataclass(frozen=True)
class Hit:
    """A declared value spelt as a literal outside its declaration."""

    where: str  # file, relative to the root scanned
    line: int
    value: str
    context: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.value!r} as {self.context}"


_COLLECTIONS = (ast.Tuple, ast.List, ast.Set, ast.Starred)
#: Calls whose second positional argument is a default (`mapping.get(key, default)`).
_DEFAULT_SECOND = ("get", "pop", "setdefault")


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_literal(node: ast.expr) -> bool:
    """`Literal` or `typing.Literal` (or `t.Literal`)."""
    return (isinstance(node, ast.Name) and node.id == "Literal") or (
        isinstance(node, ast.Attribute) and node.attr == "Literal"
    )


def _names_a_variable(node: ast.Constant, parents: Mapping[ast.AST, ast.AST]) -> bool:
    """`check(timeout, "timeout")`, `(("policy", policy), ...)`: the string is the name of a
    variable handed on beside it (to be named in a message), not a value."""
    holder = parents.get(node)
    siblings = holder.args if isinstance(holder, ast.Call) else getattr(holder, "elts", ())
    return any(isinstance(s, ast.Name) and s.id == node.value for s in siblings)


def _names_an_attribute(call: ast.Call, child: ast.AST) -> bool:
    """`getattr(module, "timeout", None)`: the second argument is an attribute's name."""
    function = call.func
    return (
        isinstance(function, ast.Name)
        and function.id in ("getattr", "hasattr", "setattr", "delattr")
        and len(call.args) > 1
        and child is call.args[1]
    )


def context(node: ast.Constant, parents: Mapping[ast.AST, ast.AST]) -> str | None:
    """Where the string `node` acts as a value, or None where it only mentions a name."""
    if _names_a_variable(node, parents):
        return None
    child: ast.AST = node
    parent = parents.get(child)
    while isinstance(parent, _COLLECTIONS):  # an element of a tuple, list or set: its holder
        child, parent = parent, parents.get(parent)
    in_collection = child is not node
    if isinstance(parent, ast.Compare):
        ops = parent.ops
        return (
            "a membership test"
            if any(isinstance(o, (ast.In, ast.NotIn)) for o in ops)
            else "a comparison"
        )
    if isinstance(parent, ast.Dict):
        return "a dict key" if any(child is key for key in parent.keys) else "a dict value"
    if isinstance(parent, ast.arguments):
        return "a parameter's default"
    if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
        return "an assigned value" if child is parent.value else None
    if isinstance(parent, ast.Return):
        return "a returned value"
    if isinstance(parent, ast.keyword):
        return f"the keyword argument {parent.arg}=" if parent.arg else "a keyword argument"
    if isinstance(parent, ast.Call):
        if _names_an_attribute(parent, child):
            return None
        function = parent.func
        if (
            isinstance(function, ast.Attribute)
            and function.attr in _DEFAULT_SECOND
            and len(parent.args) > 1
            and child is parent.args[1]
        ):
            return f"the default of .{function.attr}()"
        return "an element of an argument" if in_collection else "an argument"
    if isinstance(parent, (ast.BoolOp, ast.IfExp)):
        return (
            "a fallback" if not (isinstance(parent, ast.IfExp) and child is parent.test) else None
        )
    if isinstance(parent, ast.Subscript) and child is parent.slice and _is_literal(parent.value):
        return "a Literal type"
    if isinstance(parent, ast.MatchValue):
        return "a match case"
    if isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)) and child is parent.iter:
        return "a loop's iterable"
    return None


def scan(path: Path, values: Mapping[str, str], root: Path) -> Iterator[Hit]:
    """Every literal of a declared value in the file, outside the module declaring it."""
    where = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
    parents = _parents(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        owner = values.get(node.value)
        if owner is None or owner == where:
            continue
        found = context(node, parents)
        if found is not None:
            yield Hit(where, node.lineno, node.value, found)


def scan_tree(root: Path, package: str, values: Mapping[str, str]) -> list[Hit]:
    return [
        hit for path in sorted((root / package).rglob("*.py")) for hit in scan(path, values, root)
    ]


# ------------------------------------------------------------------------------------ the rule
def test_the_declarations_are_read_from_the_modules() -> None:
    values = declared()
    assert {"infra", "policy", "runner_error", "orphaned", "unprojectable"} <= set(values)
    assert {"emit", "drop", "keep_partial", "zero", "exclude"} <= set(values)


def test_every_declared_name_is_spelt_only_where_it_is_declared() -> None:
    hits = scan_tree(REPO, "sessions", declared())
    unexplained = [str(h) for h in hits if (h.where, h.value) not in ALLOWED]
    assert unexplained == [], (
        "a declared name spelt as a literal: import it from its declaration "
        "(sessions.vocabulary, sessions.placeholder, sessions.failure_policy), or add it to ALLOWED "
        "with why:\n" + "\n".join(unexplained)
    )
    matched = {(h.where, h.value) for h in hits}
    stale = sorted(set(ALLOWED) - matched)
    assert stale == [], f"ALLOWED entries that no longer match a literal (remove them): {stale}"


# ------------------------------------------------------------------------------ the scanner itself
SAMPLE = """\
\"\"\"A docstring naming 'infra' and emit.\"\"\"
from typing import Literal
a = x == "infra"
b = x in ("infra", "other")
c = {"infra": 1}
d = {"k": "emit"}
def f(y="emit"):
    return "infra"
class C:
    origin = "infra"
g = e.get("origin", "infra")
h = call(origin="infra")
i = call(("emit", "drop"))
j = reason or "infra"
k: Literal["emit"]
match x:
    case "infra":
        pass
for name in ("infra", "other"):
    pass
l = f"{x} is not 'infra'"
m = seconds(infra, "infra")
n = getattr(module, "infra", None)
o = call("infra")
for name, flag in (("infra", infra),):
    pass
p = e.get("infra")
q = "emit" if x else None
r = "infra" "x"
"""


def test_the_scanner_sees_each_form_and_only_values(tmp_path: Path) -> None:
    """Each context a value acts in is found, with its line; docstrings, f-string text, a
    variable's name handed on beside it, an attribute's name, a longer string and the declaring
    module are not."""
    package = tmp_path / "sessions"
    package.mkdir()
    (package / "user.py").write_text(SAMPLE, encoding="utf-8")
    (package / "declaring.py").write_text(
        'INFRA = "infra"\nORIGINS = ("infra",)\n', encoding="utf-8"
    )
    values = {"infra": "sessions/declaring.py", "emit": "sessions/elsewhere.py"}
    hits = scan_tree(tmp_path, "sessions", values)
    assert all(h.where == "sessions/user.py" for h in hits), hits
    found = {(h.line, h.value, h.context) for h in hits}
    assert found == {
        (3, "infra", "a comparison"),
        (4, "infra", "a membership test"),
        (5, "infra", "a dict key"),
        (6, "emit", "a dict value"),
        (7, "emit", "a parameter's default"),
        (8, "infra", "a returned value"),
        (10, "infra", "an assigned value"),
        (11, "infra", "the default of .get()"),
        (12, "infra", "the keyword argument origin="),
        (13, "emit", "an element of an argument"),
        (14, "infra", "a fallback"),
        (15, "emit", "a Literal type"),
        (17, "infra", "a match case"),
        (19, "infra", "a loop's iterable"),
        (24, "infra", "an argument"),
        (27, "infra", "an argument"),
        (28, "emit", "a fallback"),
    }, sorted(found)
    assert (
        str(next(h for h in hits if h.line == 3)) == "sessions/user.py:3: 'infra' as a comparison"
    )
