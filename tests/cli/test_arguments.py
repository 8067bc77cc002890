"""Every value a verb takes is bounded or non-empty, derived from the parser itself.

The walk below visits each option of each verb: one that takes a value must be declared with a
type from `sessions.cli.arguments` (bounds, or non-empty text) or with `choices`; so a new flag
cannot slip in unbounded. Values just outside the bounds, and empty names, are refused by argparse
with exit 2 and one line, before any database is touched.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessions.cli import arguments
from sessions.cli.main import build_parser

#: Positional values that are free text by nature.
FREE_TEXT: set[tuple[str, str]] = set()


def options() -> Iterator[tuple[str, argparse.Action]]:
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, sub in verbs.choices.items():
        for action in sub._actions:
            if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue  # flags
            yield verb, action


def _declared(action: argparse.Action) -> bool:
    return (
        action.choices is not None
        or isinstance(action.type, (arguments.Bounded, arguments.Text))
        or action.type is arguments.step
    )


def test_every_value_option_is_bounded_or_non_empty() -> None:
    loose = [
        f"{verb} {action.option_strings or action.dest}"
        for verb, action in options()
        if not _declared(action) and (verb, action.dest) not in FREE_TEXT
    ]
    assert loose == [], "declare these with sessions.cli.arguments (bounds or text())"


BOUNDED = [
    (verb, action) for verb, action in options() if isinstance(action.type, arguments.Bounded)
]


@pytest.mark.parametrize(
    "verb,action",
    BOUNDED,
    ids=[f"{v}:{a.option_strings[0] if a.option_strings else a.dest}" for v, a in BOUNDED],
)
def test_values_outside_the_bounds_are_refused(verb: str, action: argparse.Action) -> None:
    kind = action.type
    assert isinstance(kind, arguments.Bounded)
    step = 1 if kind.kind is int else max(abs(kind.high - kind.low) * 1e-3, 1e-9)
    for value in (kind.low - step, kind.high + step, "nan", "inf", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(str(value))
    assert kind(str(kind.low)) == kind.low and kind(str(kind.high)) == kind.high


@given(st.text(alphabet=" \t\n", max_size=4))
def test_blank_text_is_refused(blank: str) -> None:
    for _, action in options():
        if isinstance(action.type, arguments.Text):
            with pytest.raises(argparse.ArgumentTypeError, match="empty"):
                action.type(blank)


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--out", "r", "--dpi", "100000"],
        ["report", "--out", "r", "--dpi", "5000"],
        ["metrics", "--run", ""],
        ["demo", "--steps", "0"],
        ["sql", "SELECT 1", "--timeout", "-1"],
        ["export", "--partition", "val", "--step", "0", "--out", ""],
    ],
)
def test_the_cli_refuses_them_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rollout-ledger") and ("range" in err[-1] or "empty" in err[-1]), err
