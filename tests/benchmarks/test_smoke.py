"""Smoke run of the benchmark suite in CI: `python -m benchmarks --tiny` (about 20 s here).

Issue #7 asks for a quick run in CI as a smoke run whose results are not asserted. The `--tiny`
preset runs every workload and prints every figure, as `--quick` does, at a third of its time
(23 s against 72 s on 2 cores): the suite's 15-minute budget is spent on tests that assert. This test
asserts only that the suite completes and reports every figure as a finite positive number
(RSS growth may legitimately be 0: a repetition can reuse memory the process already holds).
Speed is never asserted: these numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.__main__ import main


def test_quick_suite_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--json", str(out), "--workdir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    assert result["machine"]["cpu"] and result["machine"]["python"] and result["machine"]["sqlite"]
    figures = result["figures"]
    workloads = {f["workload"] for f in figures}
    assert {"append", "projection", "replay/audit", "overhead", "batch ready"} <= workloads
    if not any(note.startswith("gateway: skipped") for note in result["notes"]):
        assert "gateway" in workloads
    if not any(note.startswith("pg append: skipped") for note in result["notes"]):
        assert "pg append" in workloads
    for figure in figures:
        value = figure["value"]
        assert math.isfinite(value), figure
        if figure["unit"] == "slope":
            continue  # a cost curve's log-log slope may be any sign (flat is about 0)
        if " added by the " in figure["name"]:
            continue  # a difference of two latencies: any sign at the tiny preset's few calls
        if figure["kind"] == "memory" and "RSS growth" in figure["name"] or "GC" in figure["name"]:
            assert value >= 0, figure  # a block may reuse memory, or run no garbage collection
        else:
            assert value > 0, figure
        assert figure["name"] in printed
    names = {(f["workload"], f["name"]) for f in figures}
    assert ("overhead", "recorder overhead per session (amortised)") in names
    assert any(w == "append" and n.startswith("ratio ledger / raw sqlite3") for w, n in names)
    assert any(w == "projection" and n.startswith("bandwidth bound") for w, n in names)
    assert any(w == "replay/audit" and n.startswith("audit") for w, n in names)
    # issue 18's baselines and targets are printed beside the figures
    assert any(
        w == "overhead" and n.startswith("ratio recorder overhead / JSONL-dump") for w, n in names
    )
    assert any(
        w == "batch ready" and n.startswith("ratio batch-ready wait / build_padded")
        for w, n in names
    )
    assert any(w == "replay/audit" and n.startswith("disk write speed") for w, n in names)
    targeted = {f["name"] for f in figures if f["target"]}
    assert "audit (check log + fold + compare in memory)" in targeted


def test_the_model_calls_benchmark_reports_each_figure_beside_its_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m benchmarks.calls` at its smallest on a SQLite file: every figure printed with
    its baseline and target (speed is never asserted)."""
    from benchmarks.calls import main as calls_main

    db = f"sqlite+aiosqlite:///{tmp_path / 'calls.db'}"
    assert calls_main(["--sessions", "2", "--calls", "3", "--reps", "1", "--db", db]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("given:")]
    assert len(lines) == 3, lines
    assert "JSONL baseline" in lines[0] and "target <= 150 µs" in lines[0]
    assert "recorded whole" in lines[2] and "target <= 1.2x" in lines[2]


def test_the_gateway_benchmark_checks_every_call_against_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m benchmarks.gateway` at its smallest: both paths measured, every call the agents
    made found in the gateway's log, and the gateway's memory read after each round."""
    from benchmarks.gateway import main as gateway_main

    out = tmp_path / "gateway.json"
    argv = ["--sessions", "2", "--calls", "2", "--rounds", "2", "--workdir", str(tmp_path)]
    assert gateway_main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["recorded"] == {"gateway": 2 * 2 * 2}
    assert len(result["rss_mib"]["gateway"]) == 1 + 2  # at start and after each round
    for path in ("direct", "gateway"):
        assert len(result["paths"][path]["p50_ms"]) == 2
    printed = capsys.readouterr().out
    assert "| gateway |" in printed and "| direct |" in printed
