"""Tracker sinks: what `log_step` writes is read back from the trackers' own files.

One module-wide recording (the demo's simulated agents, plus a hand-made step whose failed
sessions had recorded trajectories and carry awkward messages) is logged to TensorBoard and to an
offline W&B run, every step twice. Then the written files are read back -- TensorBoard's event
files with tensorboard's own `EventAccumulator`, the W&B run's `.wandb` log (its records parsed
with wandb's protobufs) and its table files -- and compared with `Ledger.metrics_dict`, with
`Ledger.metrics` rows and with the `sessions` table: every scalar once per step, at its step,
with its value (float32 in TensorBoard, as given in W&B), and the failed-sessions table.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions import Ledger, SandboxError, SyncLedger
from sessions import events as ev
from sessions.cli.demo import DemoConfig, run_demo
from sessions.errors import LedgerError
from sessions.report.text import visible
from sessions.trackers import (
    ALREADY_LOGGED,
    FAILED_COLUMNS,
    LOGGED,
    FailedSession,
    LoggedStep,
    MissingTrackerPackage,
    StepContent,
    TensorBoardTracker,
    WandbTracker,
    failed_table_key,
    log_step,
    log_step_sync,
)
from store import failed_session_samples
from tests.conftest import fresh_database

pytest.importorskip("tensorboard", reason="the trackers extra: pip install -e '.[trackers]'")
pytest.importorskip("wandb", reason="the trackers extra: pip install -e '.[trackers]'")

from tensorboard.backend.event_processing import event_accumulator as ea  # noqa: E402

RUN = "trk"
#: The hand-made step (after the demo's steps 0 and 1).
HAND_STEP = 2
MESSAGE = "tool | parser\nbroke *here* <br> <b>not html</b> & `x` [a](b) \\ _y_"
STEPS = [("train", 0), ("val", 0), ("train", 1), ("val", 1), ("val", HAND_STEP)]
TEXT = "/text_summary"  # torch's add_text appends it to the tag


# ------------------------------------------------------------------ the module's one recording
@dataclass
class Logged:
    """What the module fixture recorded and logged, and what the ledger says it should read."""

    db_url: str
    tb_dir: Path
    wandb_run_dir: Path
    expected: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    rows: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    failed: dict[tuple[str, int], list[dict[str, Any]]] = field(
        default_factory=dict
    )  # every failed session
    first: list[LoggedStep] = field(default_factory=list)
    again: list[LoggedStep] = field(default_factory=list)
    late: LoggedStep | None = None


WANDB_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_SAVE_CODE": "false",
    "WANDB_ERROR_REPORTING": "false",
    "WANDB_CONSOLE": "off",
}


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    folder = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as env:
        for name, value in WANDB_ENV.items():
            env.setenv(name, value)
        for name in (
            "WANDB_DIR",
            "WANDB_CONFIG_DIR",
            "WANDB_CACHE_DIR",
            "WANDB_DATA_DIR",
            "WANDB_ARTIFACT_DIR",
        ):
            (folder / name.lower()).mkdir()
            env.setenv(name, str(folder / name.lower()))
        with fresh_database("sqlite", folder) as url:
            out = Logged(url, folder / "tb", folder / "none")
            asyncio.run(_record_and_log(out, folder))
            yield out


async def _record_and_log(out: Logged, folder: Path) -> None:
    import wandb

    async with Ledger.open(out.db_url, run=RUN) as ledger:
        # No cancellations: the demo cancels a session 10 ms after scheduling it, and on a busy
        # machine that can land before the session is created, leaving its group unsettled.
        await run_demo(
            ledger,
            DemoConfig(steps=2, prompts=6, group_size=4, fail_rate=0.35, cancel_rate=0.0, seed=5),
        )
        await _hand_step(ledger)
        settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True, console="off")
        tb = TensorBoardTracker(out.tb_dir)
        wb = WandbTracker(
            project="rollout-ledger-test", dir=str(folder / "wandb_dir"), settings=settings
        )
        for partition, step in STEPS:
            out.first.append(await log_step(ledger, partition, step, trackers=[tb, wb]))
            out.again.append(await log_step(ledger, partition, step, trackers=[tb, wb]))
        out.late = await log_step(
            ledger, "val", 0, trackers=[WandbTracker(run=wb.run)]
        )  # W&B is at step 2
        out.wandb_run_dir = Path(wb.run.dir).parent
        tb.close()
        wb.close()
        for partition, step in STEPS:
            out.expected[partition, step] = await ledger.metrics_dict(partition, step)
            out.rows[partition, step] = await ledger.metrics(partition, step)
            async with ledger.engine.connect() as conn:
                out.failed[partition, step] = await _all_failed(conn, partition, step)
            for row in out.failed[
                partition, step
            ]:  # its trajectories, through the event store's own reads
                stream = [
                    ev.decode(stored).event
                    for stored in await ledger.store.read_stream(row["session_id"])
                ]
                row["lengths"] = [
                    (t.prompt_len, t.response_len)
                    for t in stream
                    if isinstance(t, ev.TrajectoryRecorded)
                ]


async def _hand_step(ledger: Ledger) -> None:
    """val step 2: failures after a trajectory (lengths to report), with a message markdown and
    HTML would mangle, beside successes, in two data sources."""
    step = dict(group_size=3, partition="val", global_step=HAND_STEP, runner="hand")
    for g, source in enumerate(("math", "code")):
        uid = f"hand-{g}"
        async with ledger.session(
            f"hand-{g}-ok", uid=uid, session_index=0, data_source=source, **step
        ) as s:
            await s.record_trajectory(
                prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1]
            )
            await s.post_reward(1.0)
        s = await ledger.create_session(
            f"hand-{g}-late", uid=uid, session_index=1, data_source=source, **step
        )
        await s.record_trajectory(
            prompt_ids=[1] * (5 + g), response_ids=[7] * (9 + g), response_mask=[1] * (9 + g)
        )
        await s.record_trajectory(
            prompt_ids=[1] * (11 + g), response_ids=[7] * (13 + g), response_mask=[1] * (13 + g)
        )
        await s.fail("runner_error", message=MESSAGE, error_type="ParserError")
        with pytest.raises(SandboxError):
            async with ledger.session(
                f"hand-{g}-sandbox", uid=uid, session_index=2, data_source=source, **step
            ):
                raise SandboxError("the sandbox | died")
    # a retried attempt, then success: whatever metrics the ledger counts for it are logged too
    async with ledger.session(
        "hand-2-retried", uid="hand-2", session_index=0, data_source="math", **step
    ) as s:
        await s.retry("timeout", message="first attempt hung")
        await s.start()
        await s.record_trajectory(prompt_ids=[1, 2], response_ids=[3], response_mask=[1])
        await s.post_reward(0.5)
    for index in (1, 2):
        async with ledger.session(
            f"hand-2-{index}", uid="hand-2", session_index=index, data_source="math", **step
        ) as s:
            await s.record_trajectory(prompt_ids=[1, 2], response_ids=[3], response_mask=[1])
            await s.post_reward(0.0)


async def _all_failed(conn: Any, partition: str, step: int) -> list[dict[str, Any]]:
    """Every failed session of a step, straight from the `sessions` table (the sample's reference)."""
    from sqlalchemy import text

    result = await conn.execute(
        text(
            "SELECT session_id, uid, data_source, failure_reason, error_type, message, terminal_position FROM sessions "
            "WHERE run = :run AND partition = :p AND global_step = :s AND state = 'failed' ORDER BY terminal_position"
        ),
        {"run": RUN, "p": partition, "s": step},
    )
    return [dict(row) for row in result.mappings()]


# ------------------------------------------------------------------ readers of the written files
def tensorboard(logdir: Path) -> ea.EventAccumulator:
    accumulator = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    accumulator.Reload()
    return accumulator


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline run's `.wandb` file: wandb's LevelDB-style log (a 7-byte header
    ':W&B' + magic + version, then 32 KiB blocks of chunks: crc32 4, length 2, type 1 = full,
    first, middle, last), each record a `wandb_internal_pb2.Record`. wandb 0.31 ships no Python
    reader of its own any more."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path.name} is not a W&B transaction log: {data[:7]!r}"
    records, pos, block, pending = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        else:
            raise AssertionError(
                f"chunk type {kind} at byte {pos}: not a W&B log this reader knows"
            )
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """(step, {key: value}) per history row, in the order written; JSON values parsed (NaN too)."""
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append((record.history.step.num, items))
    return rows


def parse_markdown_table(text: str) -> list[list[str]]:
    """The body rows of `failed_sessions_markdown`'s table, cells unescaped."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header, separator, *body = lines
    assert [c.strip() for c in header.strip("| ").split(" | ")] == list(FAILED_COLUMNS)
    assert separator == "|" + " --- |" * len(FAILED_COLUMNS)
    return [_cells(line) for line in body]


def _cells(line: str) -> list[str]:
    cells, current, i = [], [], 2
    line = line[:-2]  # drop the trailing " |"
    while i < len(line):
        char = line[i]
        if char == "\\":
            current.append(line[i + 1])
            i += 2
            continue
        if line.startswith(" | ", i):
            cells.append("".join(current))
            current, i = [], i + 3
            continue
        if line.startswith("<br>", i):
            current.append("\n")
            i += 4
            continue
        for entity, plain in (("&lt;", "<"), ("&amp;", "&")):
            if line.startswith(entity, i):
                current.append(plain)
                i += len(entity)
                break
        else:
            current.append(char)
            i += 1
    cells.append("".join(current))
    return cells


def same(found: float, wanted: float) -> bool:
    return (math.isnan(found) and math.isnan(wanted)) or found == wanted


# ------------------------------------------------------------------ what the calls report
def test_each_step_is_logged_once_and_the_calls_say_so(logged: Logged) -> None:
    for done, again, (partition, step) in zip(logged.first, logged.again, STEPS):
        assert (done.partition, done.global_step, done.run) == (partition, step, RUN)
        assert list(done.trackers.values()) == [LOGGED, LOGGED], done
        assert done.scalars == pytest.approx(logged.expected[partition, step], nan_ok=True)
        assert list(again.trackers.values()) == [ALREADY_LOGGED, ALREADY_LOGGED], again
        assert again.scalars == {} and again.failed == () and "nothing new" in str(again)
        assert f"{len(done.scalars)} scalars" in str(done)
    assert logged.late is not None and list(logged.late.trackers.values())[0].startswith(
        "skipped: the W&B run is at step 2"
    )


def test_the_scalars_are_verls_names_and_every_ledger_metric_row(logged: Logged) -> None:
    """The dict logged holds every metric row of the step under ledger/<p>/<source or all>/<metric>,
    whatever metrics exist, beside verl's names (`val-core/...`, `critic/score/...`) and what the
    step's failures cost (`ledger/<p>/all/cost/...`)."""
    for (partition, step), expected in logged.expected.items():
        rows = logged.rows[partition, step]
        assert rows
        for row in rows:
            key = f"ledger/{partition}/{row.data_source or 'all'}/{row.metric}"
            assert same(expected[key], row.value), key
        verl = [key for key in expected if not key.startswith("ledger/")]
        assert any(
            key.startswith("val-core/" if partition == "val" else "critic/score/") for key in verl
        )
        cost = [key for key in expected if key.startswith(f"ledger/{partition}/all/cost/")]
        assert f"ledger/{partition}/all/cost/masked_share" in cost  # what failures cost
        assert len(expected) == len(rows) + len(verl) + len(cost)


# ------------------------------------------------------------------ TensorBoard, read back
def test_tensorboard_holds_every_scalar_once_at_its_step_as_float32(logged: Logged) -> None:
    board = tensorboard(logged.tb_dir)
    wanted_tags = {key for expected in logged.expected.values() for key in expected}
    assert set(board.Tags()["scalars"]) == wanted_tags
    by_tag: dict[str, dict[int, list[float]]] = {}
    for tag in wanted_tags:
        for event in board.Scalars(tag):
            by_tag.setdefault(tag, {}).setdefault(event.step, []).append(event.value)
    for (_partition, step), expected in logged.expected.items():
        for key, value in expected.items():
            values = by_tag[key].get(step, [])
            assert len(values) == 1, f"{key} at step {step}: {values}"
            assert same(values[0], float(np.float32(value))), (key, step, values[0], value)
    logged_points = sum(len(v) for steps in by_tag.values() for v in steps.values())
    assert logged_points == sum(len(expected) for expected in logged.expected.values())


def test_tensorboard_holds_the_failed_sessions_table(logged: Logged) -> None:
    board = tensorboard(logged.tb_dir)
    assert set(board.Tags()["tensors"]) == {failed_table_key(p) + TEXT for p in ("train", "val")}
    for partition, step in STEPS:
        events = [e for e in board.Tensors(failed_table_key(partition) + TEXT) if e.step == step]
        assert len(events) == 1
        text = events[0].tensor_proto.string_val[0].decode()
        everyone = logged.failed[partition, step]
        assert text.startswith(f"{len(everyone)} failed session(s) in {partition} step {step}")
        rows = parse_markdown_table(text)
        _check_sample([dict(zip(FAILED_COLUMNS, row)) for row in rows], everyone, as_text=True)


def _check_sample(
    sample: list[dict[str, Any]], everyone: list[dict[str, Any]], *, as_text: bool
) -> None:
    """The sample is the first 3 failures of each reason (log order), reasons sorted; its columns
    are the `sessions` row's; the hand step's lengths are the last trajectory's."""
    first: dict[str, list[dict[str, Any]]] = {}
    for row in everyone:
        first.setdefault(row["failure_reason"], []).append(row)
    wanted = [row for reason in sorted(first) for row in first[reason][:3]][:20]
    assert [s["session_id"] for s in sample] == [w["session_id"] for w in wanted]
    for got, row in zip(sample, wanted):
        for column, stored in (
            ("uid", row["uid"]),
            ("data_source", row["data_source"]),
            ("reason", row["failure_reason"]),
            ("error_type", row["error_type"]),
            ("message", row["message"]),
        ):
            # both trackers show stored text as the terminal does (visible); TensorBoard's
            # markdown cells show an absent value as empty, W&B's table keeps it None
            shown = None if stored is None else visible(stored)
            wanted = (shown or "") if as_text else shown
            assert got[column] == wanted, (column, got, row)
        lengths = [got["trajectories"], got["prompt_len"], got["response_len"]]
        expected = [len(row["lengths"]), *(row["lengths"][-1] if row["lengths"] else (0, 0))]
        if row["session_id"].endswith(
            "-late"
        ):  # the hand step's: two trajectories, the last one's lengths
            assert expected == [2, 11 + int(row["uid"][-1]), 13 + int(row["uid"][-1])]
        assert lengths == ([str(n) for n in expected] if as_text else expected), (
            row["session_id"],
            lengths,
        )
        assert float(got["seconds"]) >= 0


# ------------------------------------------------------------------ W&B (offline), read back
def test_wandb_history_holds_every_scalar_once_at_its_step_exactly(logged: Logged) -> None:
    history = wandb_history(logged.wandb_run_dir)
    steps = [step for step, _ in history]
    assert steps == sorted(set(steps)) == [0, 1, 2], (
        "one history row per step (train and val merged)"
    )
    rows = dict(history)
    table_keys = {failed_table_key(p) for p in ("train", "val")}
    for step in (0, 1, 2):
        wanted = {
            k: v
            for (p, s), expected in logged.expected.items()
            if s == step
            for k, v in expected.items()
        }
        found = {
            k: v
            for k, v in rows[step].items()
            if not k.startswith("_") and not any(k.startswith(t + "/") for t in table_keys)
        }
        assert set(found) == set(wanted), step
        for key, value in wanted.items():
            assert same(float(found[key]), value), (key, step, found[key], value)


def test_wandb_holds_the_failed_sessions_table(logged: Logged) -> None:
    history = dict(wandb_history(logged.wandb_run_dir))
    for partition, step in STEPS:
        key = failed_table_key(partition)
        assert history[step][f"{key}/_type"] == "table-file"
        table = json.loads(
            (logged.wandb_run_dir / "files" / history[step][f"{key}/path"]).read_text()
        )
        assert table["columns"] == list(FAILED_COLUMNS)
        assert history[step][f"{key}/nrows"] == len(table["data"])
        _check_sample(
            [dict(zip(FAILED_COLUMNS, row)) for row in table["data"]],
            logged.failed[partition, step],
            as_text=False,
        )


# ------------------------------------------------------------------ restarts, SyncLedger, errors
async def test_a_new_tensorboard_tracker_on_the_same_logdir_does_not_log_a_step_again(
    logged: Logged,
) -> None:
    before = {p.name: p.stat().st_size for p in logged.tb_dir.glob("events.*")}
    async with Ledger.open(logged.db_url, run=RUN) as ledger:
        with TensorBoardTracker(logged.tb_dir) as again:
            done = await log_step(ledger, "val", 1, trackers=[again])
    assert done.trackers == {again.name: ALREADY_LOGGED}
    board = tensorboard(logged.tb_dir)
    assert [e.step for e in board.Scalars("ledger/val/all/reward/mean")] == [0, 1, HAND_STEP]
    assert {
        p.name: p.stat().st_size for p in logged.tb_dir.glob("events.*") if p.name in before
    } == before


async def test_two_calls_at_once_for_one_step_write_it_once(logged: Logged, tmp_path: Path) -> None:
    async with Ledger.open(logged.db_url, run=RUN) as ledger:
        with TensorBoardTracker(tmp_path / "tb") as tracker:
            both = await asyncio.gather(
                *(log_step(ledger, "val", 1, trackers=[tracker]) for _ in range(2))
            )
    assert sorted(done.trackers[tracker.name] for done in both) == [ALREADY_LOGGED, LOGGED]
    assert len(tensorboard(tmp_path / "tb").Scalars("ledger/val/all/reward/mean")) == 1


@pytest.mark.parametrize("scalars, failed_sessions", [(False, True), (True, False)])
async def test_only_the_part_asked_for_is_written(
    logged: Logged, tmp_path: Path, scalars: bool, failed_sessions: bool
) -> None:
    """verl's own Tracking may log metrics_dict; then the tracker adds only the table (and back)."""
    async with Ledger.open(logged.db_url, run=RUN) as ledger:
        with TensorBoardTracker(tmp_path / "tb") as tracker:
            done = await log_step(
                ledger,
                "val",
                1,
                trackers=[tracker],
                scalars=scalars,
                failed_sessions=failed_sessions,
            )
    tags = tensorboard(tmp_path / "tb").Tags()
    assert set(tags["scalars"]) == (set(logged.expected["val", 1]) if scalars else set())
    assert tags["tensors"] == ([failed_table_key("val") + TEXT] if failed_sessions else [])
    assert (bool(done.scalars), bool(done.failed)) == (scalars, failed_sessions)


def test_log_step_sync_from_a_synchronous_loop(logged: Logged, tmp_path: Path) -> None:
    with (
        SyncLedger.open(logged.db_url, run=RUN) as ledger,
        TensorBoardTracker(tmp_path / "tb") as tracker,
    ):
        done = log_step_sync(ledger, "val", HAND_STEP, trackers=[tracker])
        again = log_step_sync(ledger, "val", HAND_STEP, trackers=[tracker])
        expected = ledger.metrics_dict("val", HAND_STEP)
    assert done.trackers == {tracker.name: LOGGED} and again.trackers == {
        tracker.name: ALREADY_LOGGED
    }
    board = tensorboard(tmp_path / "tb")
    assert set(board.Tags()["scalars"]) == set(expected)
    for key, value in expected.items():
        (event,) = board.Scalars(key)
        assert event.step == HAND_STEP and same(event.value, float(np.float32(value)))
    # the hand step's reference values, from the metric rows themselves
    assert expected["ledger/val/all/sessions/failed"] == 4.0
    assert expected["ledger/val/math/reward/mean"] == pytest.approx((1 + 0.5) / 6)


async def test_log_step_sync_refuses_a_running_event_loop_and_a_closed_ledger(
    logged: Logged, tmp_path: Path
) -> None:
    ledger = await asyncio.to_thread(SyncLedger.open, logged.db_url, run=RUN)
    tracker = TensorBoardTracker(tmp_path / "tb")
    try:
        with pytest.raises(LedgerError, match="running event loop.*await log_step"):
            log_step_sync(ledger, "val", 0, trackers=[tracker])
    finally:
        await asyncio.to_thread(ledger.close)
        tracker.close()
    with pytest.raises(LedgerError, match="closed"):
        log_step_sync(ledger, "val", 0, trackers=[tracker])


async def test_a_step_without_a_number_or_no_tracker_is_refused(
    logged: Logged, tmp_path: Path
) -> None:
    async with Ledger.open(logged.db_url, run=RUN) as ledger:
        with TensorBoardTracker(tmp_path / "tb") as tracker:
            with pytest.raises(ValueError, match="global_step is None"):
                await log_step(ledger, "val", None, trackers=[tracker])
            with pytest.raises(ValueError, match="would log nothing"):
                await log_step(
                    ledger, "val", 0, trackers=[tracker], scalars=False, failed_sessions=False
                )
        with pytest.raises(ValueError, match="no trackers"):
            await log_step(ledger, "val", 0, trackers=[])
        with pytest.raises(TypeError, match="not a tracker"):
            await log_step(ledger, "val", 0, trackers=[object()])  # type: ignore[list-item]
    assert (
        not list((tmp_path / "tb").glob("events.*"))
        or tensorboard(tmp_path / "tb").Tags()["scalars"] == []
    )


@pytest.mark.parametrize(
    "module, make",
    [
        ("wandb", lambda folder: WandbTracker(mode="offline")),
        ("torch.utils.tensorboard", lambda folder: TensorBoardTracker(folder)),
    ],
)
def test_a_missing_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str, make: Any
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(MissingTrackerPackage, match=r"pip install -e '\.\[trackers\]'") as raised:
        make(tmp_path)
    assert isinstance(raised.value, ImportError) and isinstance(raised.value, LedgerError)


# ------------------------------------------------------------------ the store's sample, both backends
async def test_failed_session_samples_takes_the_first_of_each_reason(db_url: str) -> None:
    async with Ledger.open(db_url, run="s") as ledger:
        identity = dict(group_size=8, partition="train", global_step=4)
        reasons = [
            "timeout",
            "runner_error",
            "timeout",
            "sandbox_error",
            "timeout",
            "runner_error",
            "timeout",
            "timeout",
        ]
        for i, reason in enumerate(reasons):
            s = await ledger.create_session(f"s{i}", uid="u", session_index=i, **identity)
            if i == 1:
                await s.record_trajectory(
                    prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=[1, 1, 0]
                )
            await s.fail(reason, message=f"m{i}")
        await ledger.project()
        async with ledger.engine.connect() as conn:
            sample = await failed_session_samples(conn, "s", "train", 4, per_reason=2, limit=5)
            none = await failed_session_samples(conn, "s", "val", 4)
            with pytest.raises(ValueError, match="per_reason"):
                await failed_session_samples(conn, "s", "train", 4, per_reason=0)
    assert [(r["failure_reason"], r["session_id"]) for r in sample] == [
        ("runner_error", "s1"),
        ("runner_error", "s5"),
        ("sandbox_error", "s3"),
        ("timeout", "s0"),
        ("timeout", "s2"),
    ]
    assert none == []
    s1 = FailedSession.from_store(sample[0])
    assert (s1.trajectories, s1.prompt_len, s1.response_len, s1.message) == (1, 2, 3, "m1")
    assert FailedSession.from_store(sample[1]).trajectories == 0
    assert all(r["terminal_at"].tzinfo is not None for r in sample)


# ------------------------------------------------------------------ any values, any messages
_names = st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=12)
_messages = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    scalars=st.dictionaries(
        _names.map(lambda n: f"ledger/val/all/{n}"), st.floats(width=64), min_size=1, max_size=6
    ),
    messages=st.lists(st.one_of(st.none(), _messages), max_size=4),
    step=st.integers(0, 2**31 - 1),
)
def test_tensorboard_reads_back_any_values_and_messages(
    tmp_path_factory: pytest.TempPathFactory,
    scalars: dict[str, float],
    messages: list[str | None],
    step: int,
) -> None:
    folder = tmp_path_factory.mktemp("tb")
    failed = tuple(
        FailedSession(f"s{i}", "u|1", None, "runner_error", "E", message, i, i, 2 * i, 0.5)
        for i, message in enumerate(messages)
    )
    content = StepContent("r", "val", step, scalars, failed, len(failed))
    with TensorBoardTracker(folder) as tracker:
        assert tracker.write(content) == LOGGED
    board = tensorboard(folder)
    for key, value in scalars.items():
        (event,) = board.Scalars(key)
        with np.errstate(over="ignore"):
            assert event.step == step and same(event.value, float(np.float32(value)))
    (text,) = board.Tensors(failed_table_key("val") + TEXT)
    rows = parse_markdown_table(text.tensor_proto.string_val[0].decode())
    # every control and line end is written as the terminal shows it (a row stays on one line)
    assert [row[FAILED_COLUMNS.index("message")] for row in rows] == [
        visible(m or "") for m in messages
    ]
    assert all(row[1] == "u|1" for row in rows)
