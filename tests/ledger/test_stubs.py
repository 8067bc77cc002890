"""The typed stubs editors and type checkers read are what `python -m sessions.ledger.stubgen`
makes from the code now: each is regenerated in memory and compared with the committed file, and
read back to check that it names every public member of the faces, with its parameters, and
every public name of the lazy packages."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from sessions.ledger.stubgen import PROTOCOL, STUBS, main
from tests import REPO

REGENERATE = "run `python -m sessions.ledger.stubgen` and commit the result"


def _stub(path: str) -> ast.Module:
    return ast.parse((REPO / path).read_text(encoding="utf-8"), filename=path)


@pytest.mark.parametrize("path", sorted(STUBS))
def test_each_committed_stub_is_what_the_generator_makes_now(path: str) -> None:
    made = STUBS[path]()
    ast.parse(made, filename=path)  # a stub that is not Python would be read by no tool
    committed = REPO / path
    assert committed.exists(), f"{path} is missing: {REGENERATE}"
    assert committed.read_text(encoding="utf-8") == made, f"{path} is stale: {REGENERATE}"


def _parameter_names(arguments: ast.arguments) -> list[str]:
    named = [*arguments.posonlyargs, *arguments.args]
    named += [arguments.vararg] if arguments.vararg else []
    named += arguments.kwonlyargs + ([arguments.kwarg] if arguments.kwarg else [])
    return [argument.arg for argument in named]


def test_the_faces_stub_has_every_public_member_with_its_parameters() -> None:
    module = importlib.import_module("sessions.ledger.sync.faces")
    classes = [
        node
        for node in _stub("sessions/ledger/sync/faces.pyi").body
        if isinstance(node, ast.ClassDef)
    ]
    assert {node.name for node in classes} == {"SyncLedger", "SyncSession", "SessionProxy"}
    for node in classes:
        face = getattr(module, node.name)
        stubbed = {
            f.name: f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        public = {name for name in dir(face) if not name.startswith("_") or name in PROTOCOL}
        assert set(stubbed) == public, node.name
        for name, function in stubbed.items():
            member = inspect.getattr_static(face, name)
            member = member.fget if isinstance(member, property) else getattr(face, name)
            expected = list(inspect.signature(member).parameters)
            if isinstance(inspect.getattr_static(face, name), classmethod):
                expected.insert(0, "cls")
            assert _parameter_names(function.args) == expected, f"{node.name}.{name}"
            awaitable = inspect.iscoroutinefunction(member)
            assert isinstance(function, ast.AsyncFunctionDef) is awaitable, f"{node.name}.{name}"


@pytest.mark.parametrize("package", ["sessions", "sessions.ledger"])
def test_a_lazy_packages_stub_imports_each_of_its_public_names(package: str) -> None:
    tree = _stub(package.replace(".", "/") + "/__init__.pyi")
    imported = [
        alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names
    ]
    assert sorted(imported) == sorted(importlib.import_module(package).__all__)


def test_the_command_writes_stale_stubs_and_check_only_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check"], root=tmp_path) == 1
    assert not list(tmp_path.rglob("*.pyi")), "--check wrote a file"
    assert capsys.readouterr().out.splitlines() == [f"stale: {path}" for path in STUBS]
    assert main([], root=tmp_path) == 0
    for path, make in STUBS.items():
        assert (tmp_path / path).read_text(encoding="utf-8") == make()
    assert main(["--check"], root=tmp_path) == 0
