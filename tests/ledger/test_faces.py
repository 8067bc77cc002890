"""Faces written once: every face of the ledger and of a session (`SyncLedger`, `SyncSession`,
`SessionProxy`) with the parameters of the async original (the options are
`tests/ledger/test_config.py`'s, `log_step_sync`'s face `tests/trackers/test_step_log.py`'s).

The members and parameters compared are derived from the classes (`inspect`), never listed here;
what a face leaves out or adds on purpose is listed, with the reason beside it."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from sessions import (
    Ledger,
    SessionHandle,
    SessionProxy,
    SyncLedger,
    SyncSession,
)


def _signature(member: Any) -> inspect.Signature:
    """A member's own signature, `self`/`cls` included, under any wrapper (a context manager's)."""
    if isinstance(member, (property, staticmethod, classmethod)):
        member = member.__func__ if not isinstance(member, property) else member.fget
    return inspect.signature(inspect.unwrap(getattr(member, "__func__", member)))


# ------------------------------------------------------------------ typed faces
#: Parameters a face adds to its original's, and why.
FACE_ONLY = {
    # the loop thread's own bounds: how long any call, and the opening, may take
    (SyncLedger, "open"): {"call_timeout", "open_timeout"},
}
#: Parameters whose annotation differs on a face, and why.
FACE_TYPED = {
    # the runner is handed the face's session (a SessionProxy), not the loop-bound SessionHandle
    ("run_session", "runner"),
}
#: `Ledger` members with no awaitable (`a`-prefixed) twin on `SyncLedger`, and why: opening and
#: closing are the face's own business (`SyncLedger.open` / `close`, from any thread), and a
#: handle for another event loop comes from `asession` / `arun_session` (a `SessionProxy`), so
#: `create_session` / `load_session` have a blocking face only.
NO_AWAITABLE_TWIN = {"open", "close", "create_session", "load_session"}

FACES = [(SyncLedger, Ledger), (SyncSession, SessionHandle), (SessionProxy, SessionHandle)]


def _public(cls: type) -> dict[str, Any]:
    """A class's public members as declared (properties, functions, classmethods), own and inherited."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        members.update(
            (name, value) for name, value in vars(klass).items() if not name.startswith("_")
        )
    return members


def _parameters(face: type, name: str, member: Any) -> list[tuple[str, Any, Any, Any]]:
    """(name, kind, default, annotation) of each parameter, what a face may differ in left out."""
    out = []
    for parameter in _signature(member).parameters.values():
        if parameter.name in FACE_ONLY.get((face, name), ()):
            continue
        typed = (name, parameter.name) not in FACE_TYPED
        out.append(
            (
                parameter.name,
                parameter.kind,
                parameter.default,
                parameter.annotation if typed else "(the face's own)",
            )
        )
    return out


def _is_async(member: Any) -> bool:
    function = inspect.unwrap(getattr(member, "__func__", member))
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


@pytest.mark.parametrize(("face", "original"), FACES, ids=lambda cls: cls.__name__)
def test_every_face_has_every_member_of_its_original_with_its_parameters(
    face: type, original: type
) -> None:
    originals, faces = _public(original), _public(face)
    assert len(originals) >= 10  # the derivation sees the members
    missing = sorted(originals.keys() - faces.keys())
    assert not missing, f"{face.__name__} lacks {missing} of {original.__name__}"
    for name, member in originals.items():
        mine = faces[name]
        if isinstance(member, property):
            assert isinstance(mine, property), f"{face.__name__}.{name} is not a property"
            continue
        assert callable(getattr(face, name)), f"{face.__name__}.{name}"
        assert _parameters(face, name, mine) == _parameters(original, name, member), (
            f"{face.__name__}.{name} takes other parameters than {original.__name__}.{name}"
        )
        awaitable = face is SessionProxy
        assert _is_async(mine) == awaitable, f"{face.__name__}.{name} should block: {awaitable}"


def test_the_ledgers_awaitable_twins_have_its_parameters() -> None:
    """`SyncLedger.a<name>` for every `Ledger` member but the listed ones, awaitable, same parameters."""
    members = _public(Ledger)
    twins = {name for name in _public(SyncLedger) if name.startswith("a") and name[1:] in members}
    assert {f"a{name}" for name in members.keys() - NO_AWAITABLE_TWIN} == twins
    for twin in twins:
        name = twin[1:]
        mine = _public(SyncLedger)[twin]
        assert _is_async(mine), twin
        assert _parameters(SyncLedger, name, mine) == _parameters(Ledger, name, members[name]), twin
