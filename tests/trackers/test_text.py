"""Stored text in the TensorBoard summary is shown as the terminal shows it.

Ids and messages are user data: a raw ESC or BEL, a C1 control (0x9b, the one-byte CSI) or a bidi
override (U+202E, which visually reverses an id) must not reach the failed-sessions table.
`sessions.trackers.content` shows every cell through `sessions.report.text.visible`, the function
the terminal verbs and the HTML report use, so what a reader sees is what `rollout-ledger
history` prints, and the table's rows stay one line each.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions import Ledger, RolloutFailure
from sessions.report.text import visible
from sessions.trackers import FAILED_COLUMNS, TensorBoardTracker, log_step
from sessions.trackers.content import (
    FailedSession,
    StepContent,
    failed_sessions_markdown,
    failed_table_key,
)

#: Characters that must never reach the summary raw: C0 controls and DEL, C1 controls (0x9b-0x9d
#: among them), the bidi embeddings, overrides, isolates and marks, and the line separators.
HOSTILE = (
    [chr(c) for c in range(0x20)]
    + [chr(c) for c in range(0x7F, 0xA0)]
    + list("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
    + list("\u2028\u2029\u200b\u200d\ufeff")
)
#: Markdown and HTML the table escapes, beside the hostile characters and plain text.
MARKUP = list("|*_`[]\\&<> ")
hostile_text = st.text(
    st.one_of(
        st.sampled_from(HOSTILE),
        st.sampled_from(MARKUP),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=40,
)


def _raw(text: str) -> list[str]:
    """The characters of `text` a person would not see as themselves (line breaks between the
    table's rows aside): controls, format characters (bidi), separators but the space."""
    return [
        char
        for line in text.split("\n")
        for char in line
        if char != " " and unicodedata.category(char)[0] in "CZ"
    ]


def _cells(line: str) -> list[str]:
    """A table row's cells with the markdown and HTML escapes undone (what a reader sees)."""
    cells, current, i = [], [], 2
    body = line[:-2]
    while i < len(body):
        if body[i] == "\\":
            current.append(body[i + 1])
            i += 2
        elif body.startswith(" | ", i):
            cells.append("".join(current))
            current, i = [], i + 3
        elif body.startswith("&lt;", i):
            current.append("<")
            i += 4
        elif body.startswith("&amp;", i):
            current.append("&")
            i += 5
        else:
            current.append(body[i])
            i += 1
    cells.append("".join(current))
    return cells


def _content(run: str, failed: list[FailedSession]) -> StepContent:
    return StepContent(run, "val", 3, {}, tuple(failed), len(failed))


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(
        st.tuples(hostile_text, hostile_text, hostile_text, hostile_text, hostile_text),
        min_size=1,
        max_size=4,
    ),
    run=hostile_text,
)
def test_no_control_or_bidi_character_survives_into_the_summary(
    texts: list[tuple[str, str, str, str, str]], run: str
) -> None:
    failed = [
        FailedSession(sid, uid, source, "runner_error", error_type, message, 1, 2, 3, 0.5)
        for sid, uid, source, error_type, message in texts
    ]
    summary = failed_sessions_markdown(_content(run, failed))
    assert _raw(summary) == [], summary
    lines = summary.split("\n")
    assert len(lines) == 4 + len(failed)  # head, blank, header, separator: one line per session
    for line, session in zip(lines[4:], failed):
        shown = dict(zip(FAILED_COLUMNS, _cells(line)))
        # each cell reads as the terminal and the HTML report show the stored text
        for column in ("session_id", "uid", "data_source", "error_type", "message"):
            assert shown[column] == visible(getattr(session, column)), column


def test_the_issues_characters_are_written_as_escapes() -> None:
    sid = "s-\x1b[31mred\x07\x9b2J\x9c\x9d\u202edi-"
    summary = failed_sessions_markdown(
        _content("r", [FailedSession(sid, "u", None, "timeout", None, "a\nb", 0, 0, 0, None)])
    )
    row = summary.split("\n")[4]
    assert "s-\\\\x1b\\[31mred\\\\x07\\\\x9b2J\\\\x9c\\\\x9d\\\\u202edi-" in row, row
    assert "a\\\\nb" in row and "<br>" not in row  # a line end is an escape, as in the terminal


async def test_a_hostile_session_reaches_tensorboard_escaped(db_url: str, tmp_path: Path) -> None:
    """End to end on each backend: a session whose id, uid and message carry ESC, BEL, C1 codes
    and U+202E is recorded, logged by `log_step`, and read back from the event file escaped."""
    ea = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the trackers extra: pip install -e '.[trackers]'",
    )
    sid = "s-\x1b]0;pwned\x07-\u202etxt.exe"
    message = "tool said \x1b[2J\x9b31m\u202e\u2066gnp.exe\r\nline two"

    async def runner(handle: Any) -> None:
        raise RolloutFailure(message, reason="tool_quota")

    async with Ledger.open(db_url) as ledger:
        outcome = await ledger.run_session(
            runner,
            sid,
            uid="u\x9d\u202ex",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=3,
            timeout=10,
        )
        assert outcome.state == "failed"
        with TensorBoardTracker(tmp_path / "tb") as tracker:
            await log_step(ledger, "val", 3, trackers=[tracker], scalars=False, timeout=10)
    board = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.TENSORS: 0})
    board.Reload()
    (event,) = board.Tensors(failed_table_key("val") + "/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert _raw(text) == [], text
    (row,) = [line for line in text.split("\n")[4:]]
    shown = dict(zip(FAILED_COLUMNS, _cells(row)))
    assert shown["session_id"] == visible(sid) and shown["uid"] == visible("u\x9d\u202ex")
    assert shown["message"] == visible(message) and shown["reason"] == "tool_quota"


@settings(max_examples=50, deadline=None)
@given(texts=st.tuples(hostile_text, hostile_text, hostile_text, hostile_text, hostile_text))
def test_the_wandb_table_shows_text_as_the_summary_does(
    texts: tuple[str, str, str, str, str],
) -> None:
    """W&B renders a table's cells as given: they get `visible`'s escapes like every other view."""
    pytest.importorskip("wandb", reason="the trackers extra: pip install -e '.[trackers]'")
    from sessions.trackers import WandbTracker

    class Run:
        id, step = "fake", 0

        def __init__(self) -> None:
            self.logged: list[dict[str, Any]] = []

        def log(self, data: dict[str, Any], step: int) -> None:
            self.logged.append(data)

    sid, uid, source, error_type, message = texts
    failed = FailedSession(sid, uid, source, "runner_error", error_type, message, 1, 2, 3, 0.5)
    run = Run()
    WandbTracker(run=run).write(_content("r\x1b", [failed]))
    (table,) = [v for v in run.logged[0].values() if hasattr(v, "data")]
    (row,) = table.data
    assert row == failed.shown_row()
    assert _raw(" ".join(str(cell) for cell in row)) == []
