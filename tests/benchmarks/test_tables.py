"""The benchmark suite's reporting: every figure with its spread, the summary's order,
no retired target, and a README table that cannot drift from docs/benchmarks.md's latest run."""

from __future__ import annotations

import math

import pytest

from benchmarks import readme_table
from benchmarks.common import Report, Sampled, median, summary, table
from tests import REPO

REPO = REPO


def test_readme_table_is_generated_from_the_latest_docs_run() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    docs = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert readme_table.replace_block(readme, readme_table.render(docs)) == readme, (
        "README.md's benchmark table differs from docs/benchmarks.md: "
        "run `python -m benchmarks.readme_table`"
    )


def test_readme_quotes_no_retired_target() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index(readme_table.BEGIN) : readme.index(readme_table.END)]
    assert "eventsourcing" not in block and ">= 10x" not in block


def test_no_benchmark_prints_the_retired_eventsourcing_target() -> None:
    for path in (REPO / "benchmarks").glob("*.py"):
        assert 'target=">= 10x"' not in path.read_text(encoding="utf-8"), path


def test_median_carries_its_repetitions_through_arithmetic() -> None:
    build, per_row = median([2.0, 1.0, 4.0]), median([10.0, 12.0, 8.0])
    assert build == 2.0 and build.samples == (2.0, 1.0, 4.0)
    ratio = per_row / build  # paired repetition by repetition
    assert ratio == 5.0 and ratio.samples == (5.0, 12.0, 2.0) and ratio.paired
    speed = 100 / build
    assert speed == 50.0 and speed.samples == (50.0, 100.0, 25.0)
    diff = (per_row - build) * 2
    assert diff == 16.0 and diff.samples == (16.0, 22.0, 8.0)
    bound = median([1.0, 2.0])  # another size: every pairing, marked
    hull = build / bound
    assert not hull.paired and min(hull.samples) == 0.5 and max(hull.samples) == 4.0
    assert isinstance(float(ratio), float) and math.isclose(ratio, 5.0)


def test_every_figure_prints_its_spread_and_the_share_comes_first() -> None:
    report = Report()
    report.add("projection", "build_padded alone", 100 / median([1.0, 2.0, 4.0]), "sessions/s")
    report.add(
        "projection", "ratio", median([3.0, 6.0, 9.0]), "x", target=">= 5x", goal=(">=", 5.0)
    )
    report.add("memory", "peak", 7.0, "MiB", kind="memory", samples=[1.0, 7.0, 3.0])
    report.add("train_step", "ledger share of step time, median; width 8", 3.0, "%")
    printed = table(report.figures)
    assert "| value | min | max | reps |" in printed
    assert "| projection | build_padded alone | 50.0 | 25.0 | 100.0 | 3 | sessions/s |" in printed
    assert "| memory | peak | 7 | 1 | 7 | 3 | MiB |" in printed
    report.loads["projection"] = ([1.0, 1.0, 1.0], [2.0, 1.0, 1.0])
    lines = summary(report, [1.0, 1.0, 1.0], [2.0, 1.0, 1.0])
    assert lines[1].startswith("- ledger share of step time")
    assert "min 3, max 9 over 3" in lines[2] and "met" in lines[2]
    assert any("at start" in line and "at end" in line for line in lines)


def test_the_cost_per_session_heads_the_summary_beside_the_share_at_every_width() -> None:
    """The share alone reads as "the ledger doubles a step": each width's cost per session comes
    first, and the README quotes both."""
    report = Report()
    for width, cost, share in ((64, 0.9, 41.0), (512, 0.8, 5.0)):
        report.add("train_step", f"ledger cost per session, median; width {width}", cost, "ms")
        report.add(
            "train_step", f"ledger share of step time, median; width {width}", share, "%",
            target="< 5%", goal=("<=", 5.0),
        )  # fmt: skip
        report.add("train_step", f"ledger ms per step, median; width {width}", 100.0, "ms")
    lines = summary(report, [1.0] * 3, [1.0] * 3)
    assert [line.split(";")[0] for line in lines[1:5]] == [
        "- ledger cost per session, median",
        "- ledger share of step time, median",
    ] * 2
    assert not any("ledger ms per step" in line for line in lines)
    docs = "# Benchmarks\n\n## Results (`--full`)\n\n" + table(report.figures) + "\n"
    block = readme_table.render(docs)
    quoted = [line for line in block.splitlines() if line.startswith("| train_step")]
    assert [line.split("|")[2].strip().split(";")[0] for line in quoted] == [
        "ledger cost per session, median",
        "ledger share of step time, median",
    ] * 2


def test_the_generator_reads_the_suites_table() -> None:
    report = Report()
    report.add(
        "batch ready", "ratio", median([1.2, 1.4, 2.0]), "x", target="<= 1.5x", goal=("<=", 1.5)
    )
    report.add("batch ready", "wait", median([1.0, 2.0, 3.0]), "ms")
    docs = "\n".join(
        [
            "# Benchmarks",
            "",
            "## Results (`--full`)",
            "",
            "- Command: `python -m benchmarks --full`",
            "- Date: 2026-12-02 13:00 UTC; wall time 1 s",
            "- Load average (1/5/15 min): 1 / 1 / 1 at start, 2 / 2 / 2 at end",
            "",
            table(report.figures),
            "",
            "## Later",
            "| workload | measure | value |",
        ]
    )
    block = readme_table.render(docs)
    assert "| batch ready | ratio | 1.4 | 1.2 – 2 (3) | x | <= 1.5x | met |" in block
    assert "| wait |" not in block and "wall time" not in block
    assert "0 of 1 targets missed" in block
    with pytest.raises(readme_table.TableError):
        readme_table.render("# nothing here\n")


def test_sampled_pickles_as_a_plain_number() -> None:
    import pickle

    value = pickle.loads(pickle.dumps(median([1.0, 2.0, 3.0])))
    assert type(value) is float and value == 2.0
    assert not isinstance(-Sampled(1.0, [1.0]), bool)
