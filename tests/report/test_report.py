"""`rollout-ledger report`: the page, its figures, escaping, downsampling, bad input.

One demo run is recorded and reported once for the module (matplotlib is slow); the other tests
read that report, or plan figures without drawing them. SQLite only: the report's SQL is four
plain SELECTs (store/report_reads.py), and the demo's metric numbers are checked on both
backends elsewhere.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import struct
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from sessions import Ledger, RolloutFailure
from sessions.cli.demo import DemoConfig, run_demo
from sessions.cli.main import main
from sessions.report.data import ReportData, gather, step_tables
from sessions.report.downsample import MAX_POINTS, bucket_steps, reduce
from sessions.report.figures import FigureSpec, plan_figures
from sessions.report.write import write_report
from store import create_engine

pytest.importorskip("matplotlib", reason="the report extra (pip install -e '.[report]')")

RUN = "report-demo"
HOSTILE_ID = "<script>alert('id')</script>&\"x\""
HOSTILE_MESSAGE = '<img src=x onerror=alert(1)> & "quoted" </td></table>'
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = {
    "reward",
    "cost",
    "sessions",
    "failures",
    "coverage",
    "retries",
    "groups",
    "response_length",
}


class _Page(HTMLParser):
    """The page's <img> sources and the text of its failures table's cells."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.cells: list[str] = []
        self.scripts = 0
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")
        if tag == "script":
            self.scripts += 1
        if tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


async def _hostile_failure(s: Any) -> None:
    raise RolloutFailure(HOSTILE_MESSAGE)


async def _record(url: str) -> None:
    """A small demo run (2 steps, failures at every step) plus one hostile failed session, last."""
    async with Ledger.open(url, run=RUN) as ledger:
        await run_demo(
            ledger,
            DemoConfig(steps=2, prompts=6, group_size=3, fail_rate=0.35, cancel_rate=0.05, seed=7),
        )
        await ledger.run_session(
            _hostile_failure,
            HOSTILE_ID,
            uid="hostile",
            session_index=0,
            group_size=1,
            partition="val",
            global_step=1,
        )


async def _gathered(url: str) -> ReportData:
    engine = create_engine(url)
    try:
        return await gather(engine, RUN)
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo database, reported once through the CLI; and the series its figures were drawn from."""
    folder = tmp_path_factory.mktemp("report")
    url = f"sqlite+aiosqlite:///{folder / 'demo.db'}"
    asyncio.run(_record(url))
    out = folder / "out"
    assert main(["report", "--db", url, "--out", str(out), "--dpi", "60"]) == 0
    data = asyncio.run(_gathered(url))
    return {
        "url": url,
        "out": out,
        "data": data,
        "specs": {s.name: s for s in plan_figures(data.tables)},
        "html": (out / "index.html").read_text(encoding="utf-8"),
    }


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_every_figure_the_page_references_is_a_png_beside_it(report: dict[str, Any]) -> None:
    page = _Page()
    page.feed(report["html"])
    assert {Path(src).stem for src in page.images} == FIGURES
    for src in page.images:
        assert "/" not in src and ":" not in src, f"{src} is not a file beside index.html"
        path = report["out"] / src
        assert path.is_file(), f"index.html names {src}, which was not written"
        width, height = _png_size(path)
        assert width >= 200 and height >= 150 and path.stat().st_size > 4000, f"{src} looks empty"
    assert page.scripts == 0


def test_the_reward_figure_shows_the_inflation(report: dict[str, Any]) -> None:
    """Its series are the stored metrics, success-only >= honest everywhere and > where sessions
    failed; and the shaded band is in the PNG (pixels of the gap's color)."""
    data, spec = report["data"], report["specs"]["reward"]
    strictly = 0
    for partition, table in data.tables.items():
        panel = spec.panel(partition)
        honest, inflated = panel.get("reward/mean"), panel.get("reward/mean_success_only")
        assert panel.gap == ("reward/mean", "reward/mean_success_only")
        assert honest.x == [float(s) for s in table.steps] and honest.y == table.series(
            "reward/mean"
        )
        assert inflated.y == table.series("reward/mean_success_only")
        failed = table.series("sessions/failed", absent=0.0)
        for low, high, fails in zip(honest.y, inflated.y, failed):
            assert high >= low - 1e-12
            if fails and high > 0:
                assert high > low
                strictly += 1
    assert strictly >= 2, (
        "the demo's failures should make the success-only mean exceed the honest one"
    )
    from matplotlib.image import imread

    from sessions.report.drawing import GAP

    pixels = imread(report["out"] / "reward.png")[..., :3]
    band = [
        1 - 0.55 * (1 - int(GAP[i : i + 2], 16) / 255) for i in (1, 3, 5)
    ]  # GAP at alpha 0.55 over white
    near = (abs(pixels - band) < 0.03).all(axis=-1).sum()
    assert near > 500, f"only {near} pixels of the shaded gap in reward.png"


def test_hostile_session_ids_and_messages_are_escaped(report: dict[str, Any]) -> None:
    html = report["html"]
    assert "<script>" not in html and "<img src=x" not in html and HOSTILE_MESSAGE not in html
    assert (
        "&lt;script&gt;" in html
        and "&lt;img src=x onerror=alert(1)&gt; &amp; &quot;quoted&quot;" in html
    )
    page = _Page()
    page.feed(html)
    assert HOSTILE_ID in page.cells, "the hostile session id should read back exactly as recorded"
    assert any(HOSTILE_MESSAGE in cell for cell in page.cells)


def test_the_failures_table_lists_the_latest_failures_newest_first(report: dict[str, Any]) -> None:
    failures = report["data"].failures
    assert failures[0]["session_id"] == HOSTILE_ID  # recorded last
    positions = [f["terminal_position"] for f in failures]
    assert positions == sorted(positions, reverse=True)
    failed = sum(
        sum(t.series("sessions/failed", absent=0.0)) for t in report["data"].tables.values()
    )
    assert len(failures) == min(failed, 50)
    html = report["html"]
    for f in failures[:5]:
        assert f["terminal_at"].strftime("%Y-%m-%d %H:%M:%S UTC") in html


def test_no_retries_recorded_is_said_not_drawn_empty(report: dict[str, Any]) -> None:
    spec = report["specs"]["retries"]
    assert [[p.note for p in row] for row in spec.rows] == [["no retries recorded"]]
    assert report["data"].positions["projected"] == report["data"].positions["log_end"]
    assert "projected up to position" in report["html"]


def _synthetic(
    steps: int, *, extra: dict[str, float] | None = None
) -> list[tuple[str, int, str, float]]:
    """A metrics table of `steps` steps per partition, shaped like the projector's."""
    rng = random.Random(0)
    rows = []
    for partition in ("train", "val"):
        for step in range(steps):
            failed = {
                "timeout": float(rng.randint(0, 3)),
                "brand_new_reason": float(rng.randint(1, 2)),
            }
            lost = sum(failed.values())
            honest = 0.3 + 0.4 * step / steps
            metrics = {
                "sessions/total": 64.0,
                "sessions/failed": lost,
                "sessions/succeeded": 64.0 - lost,
                "sessions/cancelled": 0.0,
                "reward/mean": honest,
                "reward/mean_success_only": honest * 64 / (64 - lost),
                "coverage": (64 - lost) / 64,
                "groups/finished": 16.0,
                "groups/failure": 0.0,
                "response_length/mean": 400.0 + step % 7,
                "response_length/max": 900.0 + step % 101,
                **{f"failed/{r}": v for r, v in failed.items()},
                **(extra or {}),
            }
            rows += [(partition, step, name, value) for name, value in metrics.items()]
    return rows


def test_downsampling_keeps_at_most_max_points_for_1000_steps(tmp_path: Path) -> None:
    buckets = bucket_steps(list(range(1000)), 200)
    assert len(buckets.x) == 200 and buckets.size == 5 and buckets.x[0] == 2.0
    assert reduce([float(i) for i in range(1000)], buckets, "max")[:2] == [4.0, 9.0]
    assert len(bucket_steps(list(range(1001)), 200).x) <= 200
    assert reduce([math.nan, 1.0, 3.0, math.nan], bucket_steps([0, 1, 2, 3], 2)) == [1.0, 3.0]

    tables, _ = step_tables(_synthetic(1000))
    specs = plan_figures(tables)
    for spec in specs:
        assert spec.points() <= MAX_POINTS, f"{spec.name} draws {spec.points()} points"
        assert spec.steps_per_point == 5
    lengths = next(s for s in specs if s.name == "response_length").panel(
        "train (5 steps per point)"
    )
    assert max(lengths.get("response_length/max").y) == 1000.0  # a maximum survives bucketing
    data = ReportData(
        "synthetic",
        {"val": tables["val"]},
        {},
        [],
        {"projected": 1, "log_end": 1, "run_events": 1, "run_last": 1},
    )
    files = write_report(data, tmp_path / "big", dpi=40)
    assert "at most 200 points per line" in files.index.read_text()


def test_reasons_and_retries_are_found_in_the_data_not_a_fixed_list() -> None:
    retries = {
        "attempts/total": 70.0,
        "sessions/retried": 5.0,
        "retries/sandbox_error": 6.0,
        "failed_origin/infra": 2.0,
    }
    tables, _ = step_tables(_synthetic(3, extra=retries))
    specs: dict[str, FigureSpec] = {s.name: s for s in plan_figures(tables)}
    failures = specs["failures"]
    assert [s.label for s in failures.panel("val").series] == [
        "failed/brand_new_reason",
        "failed/timeout",
    ]
    assert [s.label for s in failures.panel("val", row=1).series] == ["failed_origin/infra"]
    labels = [
        [s.label for s in p.series]
        for p in (specs["retries"].panel("train", 0), specs["retries"].panel("train", 1))
    ]
    assert labels == [
        ["attempts/total", "sessions/total"],
        ["retries/sandbox_error", "sessions/retried"],
    ]
    assert all(p.note is None for row in specs["retries"].rows for p in row)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err.strip()
    return status, err


def test_bad_input_is_one_line(
    report: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    missing_db = str(tmp_path / "no-such.db")
    cases = {  # argv -> what the one line must say; --out is refused before the (missing) database is opened
        ("--db", missing_db, "--out", str(a_file)): "is a file, not a folder",
        (
            "--db",
            missing_db,
            "--out",
            str(a_file / "sub"),
        ): "is a file, so the folder cannot be created",
        (
            "--db",
            report["url"],
            "--out",
            str(tmp_path / "r"),
            "--run",
            "nope",
        ): f"run 'nope' has no events in this database; its runs (most recent first): '{RUN}'",
    }
    for args, expected in cases.items():
        status, err = _cli(["report", *args], capsys)
        assert status == 1 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "r").exists()

    empty = f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
    assert main(["migrate", "--db", empty]) == 0
    capsys.readouterr()
    status, err = _cli(["report", "--db", empty, "--out", str(tmp_path / "e")], capsys)
    assert status == 1 and "the database has no events yet" in err and len(err.splitlines()) == 1

    with (
        monkeypatch.context() as patch
    ):  # a folder this process may not write (root may write anywhere)
        patch.setattr(os, "access", lambda *a, **k: False)
        status, err = _cli(
            ["report", "--db", report["url"], "--out", str(tmp_path / "ro" / "x")], capsys
        )
    assert status == 1 and "is not writable by this process" in err and len(err.splitlines()) == 1

    with monkeypatch.context() as patch:
        patch.setitem(
            sys.modules, "matplotlib", None
        )  # import matplotlib now raises ModuleNotFoundError
        status, err = _cli(["report", "--db", report["url"], "--out", str(tmp_path / "m")], capsys)
    assert (
        err
        == (
            "rollout-ledger: error: the report draws its figures with matplotlib, which is not installed: "
            "install the report extra from the clone, pip install -e '.[report]'"
        )
        and status == 1
    ), err


def test_a_run_still_being_written_says_how_far_it_is_projected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'live.db'}"

    async def record() -> int:
        async with Ledger.open(url, run="live") as ledger:
            identity = dict(uid="u", group_size=2, partition="train", global_step=0)
            done = await ledger.create_session("live-0", session_index=0, **identity)
            await done.record_trajectory(prompt_ids=[1, 2], response_ids=[3], response_mask=[1])
            await done.complete()
            await ledger.create_session("live-1", session_index=1, **identity)  # still running
            projected = await ledger.project()  # from an empty checkpoint: the position it reaches
            await ledger.create_session(
                "live-2", uid="v", session_index=0, group_size=1, partition="val", global_step=0
            )
            return projected

    projected = asyncio.run(record())
    out = tmp_path / "live"
    assert main(["report", "--db", url, "--out", str(out), "--no-project", "--dpi", "40"]) == 0
    said = capsys.readouterr().out
    html = (out / "index.html").read_text()
    # live-2's SessionCreated and SessionStarted were appended after the projection
    assert (
        f"projected up to position {projected} of {projected + 2} (2 event(s) not projected)"
        in said
    )
    assert (
        f"Read models projected up to position {projected}; the log ended at position {projected + 2}"
        in html
    )
    assert "events past the projector's checkpoint" in html
    assert "train: 1 open session(s), 1 unsettled group(s)" in html


def test_a_run_with_nothing_projected_yet_gets_a_page_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'unprojected.db'}"

    async def record() -> None:
        async with Ledger.open(url, run="it's <new>") as ledger:
            await ledger.create_session(
                "u-0", uid="u", session_index=0, group_size=1, partition="val", global_step=0
            )

    asyncio.run(record())
    out = tmp_path / "page"
    assert main(["report", "--db", url, "--out", str(out), "--no-project"]) == 0
    assert "(nothing projected yet)" in capsys.readouterr().out
    html = (out / "index.html").read_text()
    assert "Nothing of run &quot;it&#x27;s &lt;new&gt;&quot; is projected yet" in html
    assert sorted(p.name for p in out.iterdir()) == ["index.html"]  # no figure of nothing


async def test_the_reports_reads_agree_on_both_backends(db_url: str) -> None:
    """store/report_reads.py on SQLite and PostgreSQL: step tables, step-less rows, failures newest
    first with UTC times, positions, and the run checks (no drawing here)."""
    from sessions.report.data import resolve_run

    async with Ledger.open(db_url, run="both") as ledger:
        engine = ledger.engine
        with pytest.raises(LookupError, match="the database has no events yet"):
            await resolve_run(engine, None)
        for step, index in ((0, 0), (0, 1), (1, 0), (None, 0)):
            identity = dict(
                uid=f"u{step}",
                session_index=index,
                group_size=2 if step == 0 else 1,
                partition="val",
                global_step=step,
            )
            if index == 1 or step is None:
                await ledger.run_session(_hostile_failure, f"fail-{step}-{index}", **identity)
            else:
                handle = await ledger.create_session(f"ok-{step}-{index}", **identity)
                await handle.record_trajectory(
                    prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1]
                )
                await handle.post_reward(1.0)
                await handle.complete()
        projected = await ledger.project()
        assert await resolve_run(engine, None) == "both"
        with pytest.raises(
            LookupError, match="run 'other' has no events in this database; .*: 'both'"
        ):
            await resolve_run(engine, "other")
        data = await gather(engine, "both", failures=1)
    table = data.tables["val"]
    assert list(data.tables) == ["val"] and table.steps == [0, 1]
    assert table.series("reward/mean") == [0.5, 1.0] and table.series(
        "reward/mean_success_only"
    ) == [1.0, 1.0]
    assert table.series("failed/runner_error", absent=0.0) == [1.0, 0.0]
    assert data.stepless["val"]["sessions/failed"] == 1.0
    assert [f["session_id"] for f in data.failures] == [
        "fail-None-0"
    ]  # the newest only (failures=1)
    assert (
        data.failures[0]["message"] == HOSTILE_MESSAGE
        and data.failures[0]["terminal_at"].utcoffset().total_seconds() == 0
    )
    assert data.positions == {
        "projected": projected,
        "log_end": projected,
        "run_events": projected,
        "run_last": projected,
    }


# ------------------------------------------------ how the figures read (issue 39): objects, not pixels
#: The figures whose panels show counts or lengths: their y axes start at 0.
_COUNTS_AND_LENGTHS = ("sessions", "failures", "exclusions", "retries", "groups", "response_length")


def _lengths_near_four(steps: int) -> list[tuple[str, int, str, float]]:
    """The synthetic run with response lengths between 3.77 and 4.0 (a 0.15-token dip at one
    step) and every dashed series there is: an exclusion policy's default-rule mean, excluded
    sessions, groups below min_valid; and retries."""
    rows = []
    for partition, step, name, value in _synthetic(steps):
        if name == "response_length/mean":
            value = 3.85 if step == steps // 2 else 4.0
        elif name == "response_length/max":
            value = 4.0 if step % 2 else 3.77
        rows.append((partition, step, name, value))
        if name == "reward/mean":
            rows.append((partition, step, "reward/mean_default_rule", value * 0.9))
    for partition in ("train", "val"):
        for step in range(steps):
            for name, value in {
                "sessions/excluded": 2.0,
                "excluded/timeout": 2.0,
                "groups/below_min_valid": 1.0 + step % 2,
                "attempts/total": 70.0,
                "sessions/retried": 5.0,
                "retries/sandbox_error": 6.0,
            }.items():
                rows.append((partition, step, name, value))
    return rows


def _rendered(steps: int) -> dict[str, Any]:
    from sessions.report.drawing import render

    tables, _ = step_tables(_lengths_near_four(steps))
    figures = {spec.name: (spec, render(spec, dpi=40)) for spec in plan_figures(tables)}
    for _, figure in figures.values():
        figure.canvas.draw()  # lay out: legend and axes extents are final only after a draw
    return figures


@pytest.fixture(scope="module", params=[6, 60], ids=["bars", "areas"])
def rendered(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every figure of a synthetic run drawn (not saved): few steps (bars) and many (filled areas)."""
    return _rendered(request.param)


def _drawn_axes(figure: Any) -> list[Any]:
    """The figure's panels that draw data (not hidden, not a note across an empty panel)."""
    return [a for a in figure.axes if a.get_visible() and a.get_lines()]


def test_axes_of_counts_and_lengths_start_at_zero(rendered: dict[str, Any]) -> None:
    assert set(_COUNTS_AND_LENGTHS) <= rendered.keys()
    for name in _COUNTS_AND_LENGTHS:
        spec, figure = rendered[name]
        panels = [p for row in spec.rows for p in row if p.note is None]
        assert panels and all(p.zero_based for p in panels), name
        for axes in figure.axes:
            if not axes.get_visible() or not (axes.get_lines() or axes.patches or axes.collections):
                continue
            bottom, top = axes.get_ylim()
            highest = (
                max(max(line.get_ydata()) for line in axes.get_lines()) if axes.get_lines() else 0
            )
            assert bottom == 0.0 and top >= highest, (name, axes.get_title(), bottom, top)
    _, lengths = rendered["response_length"]
    for axes in _drawn_axes(lengths):  # 3.77 .. 4.0: the axis runs from 0, so the dip is a dent
        bottom, top = axes.get_ylim()
        assert bottom == 0.0 and 4.0 < top < 5.0  # the highest line off the frame
    _, coverage = rendered["coverage"]
    assert all(a.get_ylim() == (0.0, 1.05) for a in _drawn_axes(coverage))
    spec, _ = rendered["reward"]
    assert not any(p.zero_based for row in spec.rows for p in row)  # rewards may be negative


def test_each_figure_has_one_legend_below_its_panels_covering_none(
    rendered: dict[str, Any],
) -> None:
    for name, (spec, figure) in rendered.items():
        assert all(a.get_legend() is None for a in figure.axes), f"{name}: a legend inside a panel"
        labels = {s.label for row in spec.rows for p in row if p.note is None for s in p.series}
        if not labels:
            assert figure.legends == [], name
            continue
        (legend,) = figure.legends
        shown = {t.get_text() for t in legend.get_texts()}
        assert labels <= shown, (name, labels - shown)
        renderer = figure.canvas.get_renderer()
        box = legend.get_window_extent(renderer)
        for axes in figure.axes:
            if not axes.get_visible():
                continue
            panel = axes.get_tightbbox(renderer)  # the panel with its ticks and axis labels
            assert not box.overlaps(panel), (name, axes.get_title())
            assert box.y1 <= panel.y0, f"{name}: the legend is not below {axes.get_title()!r}"


def test_dashed_lines_are_drawn_above_filled_areas_and_solid_lines(
    rendered: dict[str, Any],
) -> None:
    checked = 0
    for name, (_, figure) in rendered.items():
        for axes in figure.axes:
            dashed = [line for line in axes.get_lines() if line.get_linestyle() == "--"]
            if not dashed:
                continue
            filled = [*axes.collections, *axes.patches]
            solid = [line for line in axes.get_lines() if line.get_linestyle() == "-"]
            below = max((a.get_zorder() for a in [*filled, *solid]), default=-math.inf)
            assert filled or solid, (name, axes.get_title())
            assert min(line.get_zorder() for line in dashed) > below, (name, axes.get_title())
            checked += 1
    # the reward's default-rule line over the shaded gap, excluded sessions over the outcome
    # stacks, groups below min_valid over the group stacks: in both partitions
    assert checked >= 6


def test_the_wasted_tokens_figure_adds_up_to_each_step_s_cost(tmp_path: Path) -> None:
    """A demo run recording model calls (`--calls 3`, failures and retries): the report draws a
    wasted-tokens figure per partition whose stacked series add up, at every step, to the step's
    `cost/wasted_tokens` in `metrics_dict`; a run without calls draws none (above's report)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'calls.db'}"

    async def record_and_read() -> tuple[ReportData, dict[tuple[str, int], float]]:
        config = DemoConfig(
            steps=2,
            prompts=6,
            group_size=3,
            fail_rate=0.4,
            cancel_rate=0.0,
            seed=11,
            calls=3,
            max_attempts=2,
        )
        from sessions.cli.demo import policies

        async with Ledger.open(url, run="wasted", **policies(config)) as ledger:
            await run_demo(ledger, config)
            await ledger.project()
            costs = {
                (partition, step): (await ledger.metrics_dict(partition, step, timeout=10))[
                    f"ledger/{partition}/all/cost/wasted_tokens"
                ]
                for partition in ("train", "val")
                for step in (0, 1)
            }
        return await _gathered_run(url, "wasted"), costs

    data, costs = asyncio.run(record_and_read())
    spec = {s.name: s for s in plan_figures(data.tables)}["wasted_tokens"]
    assert sum(costs.values()) > 0
    for column, partition in enumerate(data.tables):
        panel = spec.rows[0][column]
        assert panel.series and all(s.label.startswith("wasted_tokens/") for s in panel.series)
        for i, step in enumerate(panel.series[0].x):
            drawn = sum(s.y[i] for s in panel.series)
            assert drawn == pytest.approx(costs[(partition, int(step))]), (partition, step)


async def _gathered_run(url: str, run: str) -> ReportData:
    engine = create_engine(url)
    try:
        return await gather(engine, run)
    finally:
        await engine.dispose()


def test_a_run_without_calls_draws_no_wasted_tokens_figure(report: dict[str, Any]) -> None:
    assert "wasted_tokens" not in report["specs"]


def test_the_cost_figure_draws_the_gap_and_the_masked_share(report: dict[str, Any]) -> None:
    """Per partition and step: the gap is success-only minus honest mean, the masked share is
    placeholders over rows, from the same stored metrics `rollout-ledger metrics` shows."""
    spec = report["specs"]["cost"]
    for column, (partition, table) in enumerate(report["data"].tables.items()):
        panel = spec.rows[0][column]
        gap, masked = panel.get("reward gap"), panel.get("masked share")
        assert gap is not None and masked is not None, partition
        for i, _step in enumerate(table.steps):
            expected = table.series("reward/mean_success_only")[i] - table.series("reward/mean")[i]
            assert gap.y[i] == pytest.approx(expected, nan_ok=True)
            rows = table.series("rows/total", absent=0.0)[i]
            share = table.series("placeholders", absent=0.0)[i] / rows
            assert masked.y[i] == pytest.approx(share)
        assert max(masked.y) > 0  # the demo fails sessions at every step
