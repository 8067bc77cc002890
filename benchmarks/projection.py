"""Projection: terminal sessions in the log -> verl-convention padded batches.

Subject, end to end: `Projector` over a fresh copy of a recorded (unprojected) log, then
`ledger.batch("train", step)` for every step (queue rows -> source events -> rows -> padded
TensorDict). Subject, alone: `sessions.batches.build_padded` over rows materialised beforehand.

Baselines for `build_padded` on the same rows:

* per-row Python: each row turned into tensors and padded with `torch.nn.functional.pad`, then
  `torch.stack` per column (the same columns and non-tensor columns, checked equal to
  `build_padded`'s output before timing);
* the memory-bandwidth bound: the bytes of the output tensors divided by the measured speed of a
  large torch tensor copy (`dst.copy_(src)`, 256 MiB) — no builder can write its output faster.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    Config,
    MiB,
    Report,
    RssProbe,
    add_memory,
    checkpoint_sqlite,
    copy_db,
    log,
    median,
    scratch_dir,
)
from benchmarks.workload import layout, plan, record_template

WORKLOAD = "projection"


# ------------------------------------------------------------------------ per-row baseline
def per_row_padded(rows: list[Any], pad_token_id: int = 0) -> Any:
    """The straightforward implementation: pad every row on its own, then stack."""
    import torch
    import torch.nn.functional as F
    from tensordict import NonTensorStack, TensorDict

    from sessions.batches.columns import COLUMN_DTYPES, META_COLUMNS, META_DEFAULTS, UNKNOWN_TURNS

    P = max((len(r.prompt_ids) for r in rows), default=0)
    R = max((len(r.response_ids) for r in rows), default=0)
    has_lp = any(r.logprobs is not None for r in rows)
    prompts, responses, masks, scores, attention, logprobs = [], [], [], [], [], []
    for r in rows:
        p = torch.from_numpy(np.asarray(r.prompt_ids).astype(np.int64))  # astype copies: writable
        s = torch.from_numpy(np.asarray(r.response_ids).astype(np.int64))
        m = torch.from_numpy(np.asarray(r.response_mask).astype(np.int64))
        lp, lr = p.shape[0], s.shape[0]
        prompts.append(F.pad(p, (P - lp, 0), value=pad_token_id))
        responses.append(F.pad(s, (0, R - lr), value=pad_token_id))
        masks.append(F.pad(m, (0, R - lr), value=0))
        score = torch.zeros(lr, dtype=torch.float32)
        if lr:
            score[-1] = float(r.reward)
        scores.append(F.pad(score, (0, R - lr), value=0.0))
        attention.append(
            torch.cat(
                [
                    F.pad(torch.ones(lp, dtype=torch.int64), (P - lp, 0)),
                    F.pad(torch.ones(lr, dtype=torch.int64), (0, R - lr)),
                ]
            )
        )
        if has_lp:
            values = (
                torch.zeros(lr, dtype=torch.float32)
                if r.logprobs is None
                else torch.from_numpy(np.array(r.logprobs, np.float32))
            )
            logprobs.append(F.pad(values, (0, R - lr), value=0.0))
    prompts_t, responses_t = torch.stack(prompts), torch.stack(responses)
    attention_t = torch.stack(attention)
    columns = {
        "prompts": prompts_t,
        "responses": responses_t,
        "input_ids": torch.cat([prompts_t, responses_t], dim=1),
        "attention_mask": attention_t,
        "position_ids": (attention_t.cumsum(-1) - 1).clamp(min=0),
        "response_mask": torch.stack(masks),
        "rm_scores": torch.stack(scores),
    }
    if has_lp:
        columns["rollout_log_probs"] = torch.stack(logprobs)
    columns["prompt_length"] = torch.tensor(
        [len(r.prompt_ids) for r in rows], dtype=COLUMN_DTYPES["prompt_length"]
    )
    columns["response_length"] = torch.tensor(
        [len(r.response_ids) for r in rows], dtype=COLUMN_DTYPES["response_length"]
    )
    columns["is_placeholder"] = torch.tensor(
        [bool(r.is_placeholder) for r in rows], dtype=torch.bool
    )
    turns = [int(r.meta.get("num_turns", 0 if r.is_placeholder else UNKNOWN_TURNS)) for r in rows]
    columns["num_turns"] = torch.tensor(turns, dtype=COLUMN_DTYPES["num_turns"])
    batch = TensorDict(columns, batch_size=[len(rows)])
    for name in META_COLUMNS:
        values = [r.meta.get(name, META_DEFAULTS.get(name)) for r in rows]
        batch.set(
            name,
            NonTensorStack.from_list(
                [v.item() if isinstance(v, np.generic) else v for v in values]
            ),
        )
    batch.set("__num_turns__", NonTensorStack.from_list(turns))
    batch.set("multi_modal_inputs", NonTensorStack.from_list([{} for _ in rows]))
    return batch


def check_same(expected: Any, found: Any) -> None:
    """The baseline must build what `build_padded` builds, or the comparison means nothing."""
    import torch
    from tensordict import NonTensorStack

    from sessions.batches import NON_TENSOR_COLUMNS, non_tensor

    assert list(expected.keys()) == list(found.keys()), (list(expected.keys()), list(found.keys()))
    keys = [k for k in expected.keys() if k not in NON_TENSOR_COLUMNS]
    for key in keys:
        a, b = expected.get(key), found.get(key)
        assert a.dtype == b.dtype and torch.equal(a, b), (
            f"per-row baseline differs from build_padded in {key!r}"
        )
    for name in NON_TENSOR_COLUMNS:
        # a NonTensorStack in both (build_padded's is a ColumnStack, making its members late)
        assert isinstance(expected.get(name), NonTensorStack), name
        assert isinstance(found.get(name), NonTensorStack), name
        assert non_tensor(expected, name) == non_tensor(found, name), name


def output_bytes(batch: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def copy_speed(nbytes: int = 256 * MiB, reps: int = 5) -> float:
    """Bytes per second of `dst.copy_(src)` on a large tensor (median; first copy warms up)."""
    import torch

    src = torch.ones(nbytes // 8, dtype=torch.int64)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / median(times)


# ------------------------------------------------------------------------------- the ledger
async def project_and_batch(
    db: Path, steps: int, *, keep: bool = False
) -> tuple[float, float, list[Any]]:
    """(seconds projecting, seconds building every step's batch, the batches if `keep`).

    Without `keep` each batch is dropped before the next is built, as a training loop consuming
    them would, so peak memory is one batch's, not all steps'.
    """
    from sessions import Ledger

    batches = []
    async with Ledger.open(f"sqlite+aiosqlite:///{db}", run="bench") as ledger:
        start = time.perf_counter()
        await ledger.project()
        projected = time.perf_counter()
        for step in range(steps):
            batch = await ledger.batch("train", step, timeout=60)
            if keep:
                batches.append(batch)
            del batch
        done = time.perf_counter()
    return projected - start, done - projected, batches


async def materialised_rows(db: Path, steps: int) -> list[list[Any]]:
    """Every step's BatchRows, read from a projected log (setup: not timed)."""
    from sessions.batches.rows import materialise
    from store import create_engine
    from store import read_models as rm

    engine = create_engine(f"sqlite+aiosqlite:///{db}")
    try:
        out = []
        async with engine.connect() as conn:
            for step in range(steps):
                queue = await rm.queue_rows_for(conn, "bench", "train", step)
                sources = await rm.source_events(conn, [q["source_position"] for q in queue])
                out.append(materialise(queue, sources))
        return out
    finally:
        await engine.dispose()


def run(cfg: Config, report: Report) -> None:
    from sessions.batches import build_padded

    specs = layout(
        cfg.projection_steps,
        cfg.projection_uids,
        cfg.group_size,
        fail_rate=cfg.fail_rate,
        seed=cfg.seed,
        prefix="p",
    )
    work = plan(len(specs), seed=cfg.seed + 2)
    sessions = len(specs)
    with scratch_dir(cfg, WORKLOAD) as tmp:
        template = tmp / "template.db"
        started = time.perf_counter()
        asyncio.run(record_template(template, specs, work, project=False))
        checkpoint_sqlite(template)
        log(f"  projection: recorded {sessions} sessions in {time.perf_counter() - started:.1f}s")

        # setup: rows for build_padded alone, from one projected copy; baseline checked equal
        copy_db(template, tmp / "rows.db")
        _, _, reference = asyncio.run(
            project_and_batch(tmp / "rows.db", cfg.projection_steps, keep=True)
        )
        rows = asyncio.run(materialised_rows(tmp / "rows.db", cfg.projection_steps))
        n_rows = sum(len(r) for r in rows)
        tokens = sum(len(r.prompt_ids) + len(r.response_ids) for step in rows for r in step)
        out_bytes = 0
        for step_rows, batch in zip(rows, reference):
            built = build_padded(step_rows)
            check_same(batch, built)
            check_same(built, per_row_padded(step_rows))
            out_bytes += output_bytes(built)
        del reference, built

        project_s, batch_s, build_s, per_row_s, rss, build_rss = [], [], [], [], [], []
        for rep in range(cfg.reps):
            db = tmp / f"rep{rep}.db"
            copy_db(template, db)
            with RssProbe() as probe:
                p, b, batches = asyncio.run(project_and_batch(db, cfg.projection_steps))
            del batches
            rss.append(probe)
            project_s.append(p)
            batch_s.append(b)
            db.unlink()
            with RssProbe() as probe:
                start = time.perf_counter()
                for step_rows in rows:
                    build_padded(step_rows)
                build_s.append(time.perf_counter() - start)
            build_rss.append(probe)
            start = time.perf_counter()
            for step_rows in rows:
                per_row_padded(step_rows)
            per_row_s.append(time.perf_counter() - start)
            log(
                f"  projection rep {rep + 1}/{cfg.reps}: project {p:.2f}s, batches {b:.2f}s, "
                f"build_padded {build_s[-1]:.3f}s, per-row {per_row_s[-1]:.3f}s"
            )
        speed = copy_speed(cfg.copy_mib * MiB)
        bound = out_bytes / speed

        p, b, build, per_row = (
            median(project_s),
            median(batch_s),
            median(build_s),
            median(per_row_s),
        )
        n = cfg.projection_steps
        report.add(
            WORKLOAD,
            f"Projector + ledger.batch x{n} ({sessions} sessions, {n_rows} rows)",
            sessions / (p + b),
            "sessions/s",
        )
        report.add(WORKLOAD, "Projector + ledger.batch", tokens / (p + b), "tokens/s")
        report.add(WORKLOAD, "  of which Projector.run over the log", sessions / p, "sessions/s")
        report.add(
            WORKLOAD,
            f"  of which ledger.batch x{n} (read rows, materialise, build)",
            sessions / b,
            "sessions/s",
        )
        report.add(WORKLOAD, "build_padded alone", sessions / build, "sessions/s")
        report.add(WORKLOAD, "build_padded alone", tokens / build, "tokens/s")
        report.add(WORKLOAD, "per-row F.pad + stack baseline", sessions / per_row, "sessions/s")
        report.add(WORKLOAD, "per-row F.pad + stack baseline", tokens / per_row, "tokens/s")
        report.add(
            WORKLOAD,
            f"bandwidth bound ({out_bytes / MiB:,.0f} MiB out / {speed / 1e9:.1f} GB/s copy)",
            sessions / bound,
            "sessions/s",
        )
        report.add(
            WORKLOAD,
            "ratio build_padded / per-row (speed)",
            per_row / build,
            "x",
            target=">= 5x",
            goal=(">=", 5.0),
            kind="ratio",
        )
        report.add(
            WORKLOAD,
            "ratio build_padded time / bandwidth bound",
            build / bound,
            "x",
            target="<= 2x",
            goal=("<=", 2.0),
            kind="ratio",
        )
        report.add(
            WORKLOAD, "ratio end-to-end / per-row (speed)", per_row / (p + b), "x", kind="ratio"
        )
        report.add(
            WORKLOAD, "ratio end-to-end time / bandwidth bound", (p + b) / bound, "x", kind="ratio"
        )

        def traced() -> None:
            copy_db(template, tmp / "traced.db")
            asyncio.run(project_and_batch(tmp / "traced.db", cfg.projection_steps))

        add_memory(report, cfg, WORKLOAD, "Projector + ledger.batch", rss, traced)

        def traced_build() -> None:
            for step_rows in rows:
                build_padded(step_rows)

        add_memory(report, cfg, WORKLOAD, "build_padded", build_rss, traced_build)
