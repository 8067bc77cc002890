"""Dataset export (`sessions.export.export_dataset`) beside pyarrow's own write of the same arrays.

The log is built as the replay workload builds its own (the append workload's token sizes, train
and val steps, a share of sessions failed; `--full`: the replay log's size, ~100k events; quick
and tiny: 100 sessions at most), recorded once into a template file and projected.
Each repetition exports it to Parquet, one row per session, from a fresh engine:

* subject: `export_dataset(url, out.parquet)` — sessions read page by page, trajectory data
  parsed, the exported trajectories' payloads fetched and decoded, Arrow arrays built, written.
* baseline (the floor): `pyarrow.parquet.write_table` of the very table the export wrote (read
  back once, untimed), with the same compression and row-group size: what writing those arrays
  costs with no database, no decoding and no Python per row.

Reported: sessions/s, MB/s (of the Arrow data written, `Table.nbytes`, the same bytes for both),
the ratio export time / floor time, and the peak RSS growth of an export (bounded by a page, not
by the log).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from benchmarks.common import Config, Report, RssProbe, log, median, rss_label, scratch_dir
from benchmarks.workload import layout_for, plan, projected_template

WORKLOAD = "export"
ROW_GROUP_SIZE = 1000
#: Sessions of the --quick / --tiny log: the smoke test runs it, and the suite's time is tight.
QUICK_SESSIONS = 100


async def export_once(
    db: Path, out: Path, *, per: str = "session", format: str = "parquet"
) -> tuple[float, int, int]:
    """(seconds, rows, bytes) of one export from a fresh engine."""
    from sessions.export import export_dataset

    start = time.perf_counter()
    summary = await export_dataset(
        f"sqlite+aiosqlite:///{db}", out, format=format, per=per, row_group_size=ROW_GROUP_SIZE
    )
    return time.perf_counter() - start, summary.rows, summary.bytes


def run(cfg: Config, report: Report) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        report.note(WORKLOAD, "skipped: pyarrow is not installed (pip install -e '.[export]')")
        return
    sessions = (
        cfg.replay_sessions if cfg.mode == "full" else min(cfg.replay_sessions, QUICK_SESSIONS)
    )
    specs = layout_for(sessions, cfg.group_size, fail_rate=cfg.fail_rate, seed=cfg.seed, prefix="x")
    work = plan(len(specs), seed=cfg.seed + 5)
    with scratch_dir(cfg, "export") as tmp:
        template = tmp / "template.db"
        events = projected_template(template, specs, work, "export")
        subject_s, floor_s, jsonl_s, trajectory_s, rss = [], [], [], [], []
        rows = size = 0
        table = None
        for rep in range(cfg.reps):
            out = tmp / f"out{rep}.parquet"
            with RssProbe() as probe:
                elapsed, rows, size = asyncio.run(export_once(template, out))
            rss.append(probe)
            subject_s.append(elapsed)
            if table is None:
                table = pq.read_table(out)
            floor = tmp / f"floor{rep}.parquet"
            start = time.perf_counter()
            pq.write_table(table, floor, compression="zstd", row_group_size=ROW_GROUP_SIZE)
            floor_s.append(time.perf_counter() - start)
            elapsed, trajectory_rows, _ = asyncio.run(
                export_once(template, tmp / f"t{rep}.parquet", per="trajectory")
            )
            trajectory_s.append(elapsed)
            elapsed, _, _ = asyncio.run(
                export_once(template, tmp / f"j{rep}.jsonl", format="jsonl")
            )
            jsonl_s.append(elapsed)
            for path in tmp.iterdir():
                if path.name != template.name:
                    path.unlink()
            log(
                f"  export rep {rep + 1}/{cfg.reps}: {rows / subject_s[-1]:,.0f} sessions/s; pyarrow floor "
                f"{floor_s[-1]:.3f}s vs export {subject_s[-1]:.3f}s"
            )
        assert table is not None
        data_mb = table.nbytes / 1e6
        s, f = median(subject_s), median(floor_s)
        report.add(
            WORKLOAD,
            f"export to Parquet, per session ({rows} sessions, {events} events, {data_mb:,.1f} MB of Arrow data)",
            rows / s,
            "sessions/s",
        )
        report.add(WORKLOAD, "export to Parquet, per session", data_mb / s, "MB/s")
        report.add(
            WORKLOAD,
            "baseline: pyarrow write_table of the same table (the floor)",
            data_mb / f,
            "MB/s",
        )
        report.add(
            WORKLOAD,
            "ratio export time / pyarrow floor time",
            s / f,
            "x",
            target="<= 2x (issue 30)",
            goal=("<=", 2.0),
            kind="ratio",
        )
        report.add(
            WORKLOAD,
            f"export to Parquet, per trajectory ({trajectory_rows} rows)",
            trajectory_rows / median(trajectory_s),
            "rows/s",
        )
        report.add(WORKLOAD, "export to JSONL, per session", rows / median(jsonl_s), "sessions/s")
        report.add(
            WORKLOAD,
            f"export: peak {rss_label(rss[-1].method)}",
            max(p.mib for p in rss),
            "MiB",
            kind="memory",
        )
        report.note(
            WORKLOAD,
            f"output {size / 1e6:,.1f} MB of zstd Parquet for {data_mb:,.1f} MB of Arrow data; "
            f"row groups of {ROW_GROUP_SIZE} sessions",
        )
