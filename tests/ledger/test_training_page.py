"""`docs/training.md`'s first-hour section runs as printed (issue 39): its Python blocks, joined
in order, are one script; run as a user would run it (a fresh interpreter, its own folder), it
prints exactly the page's text block, and nothing on stderr."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests import REPO

PAGE = REPO / "docs" / "training.md"
SECTION = "## Your first hour: a loop of your own"


def _section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : None if end < 0 else end]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)


def test_the_first_hour_section_runs_as_printed_and_prints_what_it_shows(tmp_path: Path) -> None:
    section = _section()
    script, (printed,) = "\n".join(_blocks(section, "python")), _blocks(section, "text")
    assert "SyncLedger" in script and "session.attempt" in script
    assert "grpo_outcome_advantage" in script and "post_reward" in script
    path = tmp_path / "first_hour.py"
    path.write_text(script, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == printed


def test_the_section_names_what_a_newcomer_needs() -> None:
    """The page says what the batch is (its columns, or the contract's table), how a hand-written
    GRPO keeps placeholders out of its baseline, and what a runner without a reward becomes."""
    section = _section()
    for needed in (
        "design.md §6",
        "is_placeholder",
        "baseline",
        "session.attempt",
        "SyncLedger",
        "without `post_reward`",
        "reward/absent",
    ):
        assert needed in section, needed
