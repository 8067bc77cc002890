"""The synchronous faces are derived from the async originals, not written out
(`sessions.ledger.sync.faces`): each public `async def` of `Ledger` is a blocking method of
`SyncLedger` and an `a`-prefixed awaitable one, each command of `SessionHandle` a blocking method
of `SyncSession` and an awaitable one of `SessionProxy`, with the original's signature and
docstring. `OWN` is the one list of what `SyncLedger` writes itself instead, with why.

The members compared are read from the classes (`inspect`), never listed here."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest

from sessions import Ledger, SessionHandle, SessionProxy, SyncLedger, SyncSession
from sessions.errors import InvalidArgument
from sessions.ledger.stubgen import Imports, class_stub
from sessions.ledger.sync.faces import OWN, derive


def _public(cls: type) -> dict[str, Any]:
    """A class's public members as declared (properties, functions, classmethods), own and inherited."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        members.update((n, m) for n, m in vars(klass).items() if not n.startswith("_"))
    return members


def _derived(member: Any, original: Any) -> bool:
    return getattr(member, "__wrapped__", None) is original and member.__doc__ == original.__doc__


def assert_derived(method: Any, original: Any, *, awaits: bool, session: type) -> None:
    """`method` is `original` carried over: its docstring and parameters, awaitable or blocking,
    a `SessionHandle` it returns given back as the face's `session`."""
    name = method.__qualname__
    assert _derived(method, original) and original.__doc__, f"{name}: not carried over"
    assert inspect.iscoroutinefunction(method) is awaits, f"{name} should be awaitable: {awaits}"
    mine, theirs = inspect.signature(method), inspect.signature(original)
    assert mine.parameters == theirs.parameters, f"{name} takes other parameters than the original"
    handle = theirs.return_annotation == "SessionHandle"
    assert mine.return_annotation == (session.__name__ if handle else theirs.return_annotation)


def test_each_ledger_method_is_derived_twice_unless_the_face_writes_it_for_a_reason() -> None:
    members = _public(Ledger)
    assert {"batch", "metrics", "metrics_dict", "create_session", "project"} <= members.keys()
    for name, member in members.items():
        if name in OWN:
            assert not _derived(vars(SyncLedger)[name], member), f"OWN lists {name}: write it"
            continue
        assert_derived(vars(SyncLedger)[name], member, awaits=False, session=SyncSession)
        assert_derived(vars(SyncLedger)[f"a{name}"], member, awaits=True, session=SessionProxy)


def test_every_public_member_of_sync_ledger_is_derived_or_listed_with_its_reason() -> None:
    """Nothing public on the face goes unexplained, and nothing listed is missing."""
    members = _public(Ledger)
    for name, member in _public(SyncLedger).items():
        plain = name[1:] if name.startswith("a") and name[1:] in members else name
        assert plain in OWN or _derived(member, members.get(plain)), f"SyncLedger.{name}"
    assert set(OWN) <= set(vars(SyncLedger)), "OWN lists a member SyncLedger does not write"
    assert all(reason.strip() for reason in OWN.values())
    assert {"asession", "arun_session"} <= set(vars(SyncLedger)) and "aclose" not in vars(
        SyncLedger
    )


@pytest.mark.parametrize(("face", "awaits"), [(SyncSession, False), (SessionProxy, True)])
def test_the_session_faces_derive_every_command_and_property(face: type, awaits: bool) -> None:
    originals = _public(SessionHandle)
    assert originals.keys() == _public(face).keys()
    assert {"record_trajectory", "post_reward", "complete", "state", "view"} <= originals.keys()
    for name, member in originals.items():
        mine = vars(face)[name]
        if isinstance(member, property):
            assert isinstance(mine, property) and mine.__doc__ == member.__doc__, name
            assert mine.fget.__wrapped__ is member.fget
            assert inspect.signature(mine.fget) == inspect.signature(member.fget)
        else:
            assert_derived(mine, member, awaits=awaits, session=face)


def test_a_session_handle_comes_back_as_the_faces_session(tmp_path: Path) -> None:
    identity = {"session_index": 0, "group_size": 1, "partition": "train", "global_step": 0}
    with SyncLedger.open(str(tmp_path / "faces.db"), call_timeout=60) as ledger:
        blocking = ledger.create_session("b", uid="b", **identity)
        assert type(blocking) is SyncSession and type(ledger.load_session("b")) is SyncSession

        async def elsewhere() -> tuple[SessionProxy, str, SessionProxy]:
            proxy = await ledger.acreate_session("p", uid="p", **identity)
            await proxy.record_trajectory(prompt_ids=[1], response_ids=[2])
            return proxy, await proxy.complete(), await ledger.aload_session("p")

        proxy, state, loaded = asyncio.run(elsewhere())
        assert (type(proxy), state, type(loaded), loaded.state) == (
            SessionProxy,
            "succeeded",
            SessionProxy,
            "succeeded",
        )
        assert repr(blocking) == "SyncSession('b', state='running')"


# ------------------------------------------------------------------ a method added in one place
class _Tallying(Ledger):
    """A `Ledger` with one public method more, as someone adding one to `Ledger` would write it."""

    async def tally(self, partition: str, *, scale: float = 2.0) -> tuple[bool, str, float]:
        """Whether it ran on the ledger's own loop, and the arguments it was given."""
        return asyncio.get_running_loop() is self._loop, partition, scale


def test_a_method_added_to_the_ledger_is_on_both_faces_and_in_the_stub(tmp_path: Path) -> None:
    """Adding a public `async def` to `Ledger` is the one edit: the derivation, run on the
    class, gives it to the blocking face, the awaitable face and the generated stub."""
    face = derive(_Tallying, awaitable="a", own=OWN)(type("TallyingLedger", (SyncLedger,), {}))
    assert_derived(vars(face)["tally"], _Tallying.tally, awaits=False, session=SyncSession)
    assert_derived(vars(face)["atally"], _Tallying.tally, awaits=True, session=SessionProxy)
    assert not hasattr(SyncLedger, "tally"), "deriving a subclass left SyncLedger as it was"
    stub = class_stub(face, Imports([]))
    signature = "(self, partition: str, *, scale: float = 2.0) -> tuple[bool, str, float]:"
    docstring = (
        '\n        """Whether it ran on the ledger\'s own loop, and the arguments it was given."""'
    )
    assert f"\n    def tally{signature}{docstring}" in stub
    assert f"\n    async def atally{signature}{docstring}" in stub
    with face.open(str(tmp_path / "tally.db"), call_timeout=60) as sync:
        assert type(sync.ledger) is _Tallying
        assert sync.tally("train") == (True, "train", 2.0)
        assert asyncio.run(sync.atally("val", scale=0.5)) == (True, "val", 0.5)


def test_an_annotation_the_stub_cannot_import_is_refused_naming_the_fix() -> None:
    class Odd:
        def odd(self) -> None: ...

    Odd.odd.__annotations__["return"] = "Elsewhere"
    with pytest.raises(InvalidArgument, match="imports or defines 'Elsewhere'.*import it there"):
        class_stub(Odd, Imports([]))
