"""`rollout-ledger` end to end, as a user runs it: subprocesses on a SQLite file (docs/design.md §11).

One demo database is recorded per module; each test reads it with another verb.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

STEPS, PROMPTS, GROUP = 3, 32, 4


def _command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("rollout-ledger")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sessions.cli.main"]


def cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [*_command(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


@pytest.fixture(scope="module")
def demo(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[tuple[str, int | None, str | None], dict[str, float]]]:
    """(database file, metrics by (partition, step, data_source)) of one demo run."""
    folder = tmp_path_factory.mktemp("cli")
    db = folder / "demo.db"
    ok(
        cli(
            "demo",
            "--db",
            str(db),
            "--steps",
            str(STEPS),
            "--prompts",
            str(PROMPTS),
            "--group-size",
            str(GROUP),
            "--fail-rate",
            "0.25",
            "--seed",
            "7",
            cwd=folder,
        )
    )
    listed = json.loads(ok(cli("metrics", "--db", str(db), "--json", cwd=folder)).stdout)
    metrics: dict[tuple[str, int | None, str | None], dict[str, float]] = defaultdict(dict)
    for row in listed:
        assert set(row) == {"run", "partition", "global_step", "data_source", "metric", "value"}
        metrics[(row["partition"], row["global_step"], row["data_source"])][row["metric"]] = row[
            "value"
        ]
    assert len({row["run"] for row in listed}) == 1
    return db, dict(metrics)


def test_demo_reports_failures_as_zeros(demo: Any) -> None:
    _db, metrics = demo
    failures = 0
    for step in range(STEPS):
        for partition in ("train", "val"):
            m = metrics[(partition, step, None)]
            assert m["sessions/total"] == PROMPTS * GROUP
            assert (
                m["sessions/succeeded"] + m["sessions/failed"] + m["sessions/cancelled"]
                == m["sessions/total"]
            )
            assert m["groups/total"] == PROMPTS and m["groups/unsettled"] == 0
            assert (
                m["placeholders"] == m["sessions/failed"]
            )  # the default policy emits one per failure
            assert sum(v for k, v in m.items() if k.startswith("failed/")) == m["sessions/failed"]
        val = metrics[("val", step, None)]
        failures += int(val["sessions/failed"])
        if val["sessions/failed"] > 0:
            assert val["reward/mean"] < val["reward/mean_success_only"], f"val step {step}: {val}"
    assert failures > 0, "a 25% fail rate must produce failures"


def test_export_padded_batch_has_one_placeholder_per_failure(demo: Any, tmp_path: Path) -> None:
    import torch

    db, metrics = demo
    out = tmp_path / "val0.pt"
    ok(
        cli(
            "export",
            "--db",
            str(db),
            "--partition",
            "val",
            "--step",
            "0",
            "--out",
            str(out),
            cwd=tmp_path,
        )
    )
    batch = torch.load(out, weights_only=True)
    val0 = metrics[("val", 0, None)]
    assert int(batch["is_placeholder"].sum()) == val0["sessions/failed"]
    rows = batch["responses"].shape[0]
    assert len(batch["key"]) == len(batch["uid"]) == rows
    assert set(batch["partition"]) == {"val"}
    placeholders = batch["is_placeholder"]
    assert int(batch["response_mask"][placeholders].sum()) == 0
    assert batch["attention_mask"][placeholders].sum(-1).tolist() == [2] * int(placeholders.sum())
    # verl's critic/score/mean over the exported rows is the ledger's reward/mean
    score = batch["rm_scores"].sum(-1).double()
    assert float(score[batch["response_length"] > 0].mean()) == pytest.approx(val0["reward/mean"])
    assert float(score[~placeholders].mean()) == pytest.approx(val0["reward/mean_success_only"])


def test_export_jagged_loads(demo: Any, tmp_path: Path) -> None:
    import torch

    db, metrics = demo
    out = tmp_path / "val0-jagged.pt"
    ok(
        cli(
            "export",
            "--db",
            str(db),
            "--partition",
            "val",
            "--step",
            "0",
            "--out",
            str(out),
            "--jagged",
            cwd=tmp_path,
        )
    )
    plain = torch.load(out, weights_only=True)
    assert int(plain["is_placeholder"].sum()) == metrics[("val", 0, None)]["sessions/failed"]
    rows = plain["is_placeholder"].shape[0]
    assert plain["responses.offsets"].shape[0] == rows + 1
    assert (
        int(plain["responses.offsets"][-1])
        == plain["responses.values"].shape[0]
        == int(plain["response_length"].sum())
    )


def test_history_of_an_unknown_session_fails_with_one_line(demo: Any, tmp_path: Path) -> None:
    db, _metrics = demo
    result = cli("history", "no-such-session", "--db", str(db), cwd=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-session" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_diagram_prints_mermaid(tmp_path: Path) -> None:
    result = ok(cli("diagram", cwd=tmp_path))
    assert "stateDiagram" in result.stdout
    for edge in (
        "created --> running",
        "running --> succeeded",
        "running --> failed",
        "running --> cancelled",
    ):
        assert edge in result.stdout


def test_project_follow_refuses_a_nonsense_backoff_in_one_line(tmp_path: Path) -> None:
    result = cli(
        "project",
        "--db",
        str(tmp_path / "x.db"),
        "--follow",
        "--backoff",
        "2",
        "--max-backoff",
        "1",
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "backoff" in result.stderr, result.stderr


def test_project_follow_stops_cleanly_on_sigterm(demo: Any, tmp_path: Path) -> None:
    import signal

    db, _ = demo
    copy = tmp_path / "follow.db"
    copy.write_bytes(db.read_bytes())

    async def unprojected_session() -> None:
        """One session past the checkpoint: the follower's first page prints, once its SIGTERM
        handler is in place, so the signal is sent at a known point rather than after a sleep."""
        from sessions import Ledger

        async with Ledger.open(str(copy), migrate=False) as ledger:
            async with ledger.session(
                "follow-me", uid="follow", session_index=0, group_size=1, partition="val"
            ) as handle:
                await handle.record_trajectory(prompt_ids=[1], response_ids=[2])
                await handle.post_reward(1.0)

    import asyncio

    asyncio.run(unprojected_session())
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_LEDGER_DB"}
    follower = subprocess.Popen(
        [
            *_command(),
            "project",
            "--db",
            str(copy),
            "--follow",
            "--poll",
            "0.1",
            "--backoff",
            "0.1",
            "--max-backoff",
            "0.2",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout is not None
    first = follower.stdout.readline()  # its first page: the handlers are installed by then
    assert first.startswith("projected "), first + follower.stderr.read()
    follower.send_signal(signal.SIGTERM)
    out, err = follower.communicate(timeout=30)
    assert follower.returncode == 0, err
    assert out.strip().splitlines()[-1].startswith("projected "), out
