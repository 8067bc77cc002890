"""The ledger's cost in a real training step: `examples/train_grpo.py`'s loop, timed by its clock.

Each step of that loop records 128 agent runs as sessions (16 prompts x 8 samples, failures,
retries and preemptions included), projects them, reads the step's batch and `metrics_dict`, and
updates a small transformer with verl's GRPO; every 5th step adds a validation step of 128 more
sessions. The example's `Clock` splits each step's wall time into the ledger (any moment a ledger
call is in flight and the policy is not computing: an upper bound), the policy (sampling, update)
and the rest (tool waits, the loop's own code).

Two headline figures per policy size, each the median over the steps after the first (which
pays one-time costs) with the steps' min and max: the ledger's **cost per session** (its time in
a step over the sessions the step recorded), which does not depend on the policy, and its
**share of step time**, which is that cost against the policy's own and so falls as the policy
grows. Both at three policy sizes in the same run (`--quick` and `--full`): the example's (width
64, 0.1M parameters, where the share is largest) and policies 4x and 8x as wide (1.6M and 6.3M
parameters), so the share is never quoted without its trend. Then the ledger's and the policy's
milliseconds per step and the ledger's by phase.

Baseline: the policy's own time in the same steps. Needs verl (the example's update is
verl's); without it the workload is skipped with a note.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import Config, Report, log, median, scratch_dir

WORKLOAD = "train_step"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: (policy width, steps) per size: the example's policy (width 64) and two wider ones, with
#: fewer steps (a step at width 512 takes seconds on 2 cores); --tiny (CI's smoke run) only checks
#: that the figures are there
RUNS = {
    "tiny": ((64, 3),),
    "quick": ((64, 12), (256, 6), (512, 4)),
    "full": ((64, 60), (256, 20), (512, 10)),
}
VAL_EVERY = 5
GOAL_PERCENT = 5.0


def import_example() -> Any | None:
    """The example's module, or None when verl (which it trains with) is not installed."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_grpo
    except ImportError as error:
        if "verl" not in str(error):
            raise
        return None
    finally:
        sys.path.remove(str(EXAMPLES))
    return train_grpo


def run(cfg: Config, report: Report) -> None:
    example = import_example()
    if example is None:
        report.note(WORKLOAD, "skipped: verl is not installed (pip install -e '.[verl]')")
        return
    for width, steps in RUNS[cfg.mode]:
        with scratch_dir(cfg, WORKLOAD) as folder:
            settings = example.Settings(
                steps=steps,
                seed=cfg.seed,
                db=str(folder / "train.db"),
                val_every=VAL_EVERY,
                width=width,
                evidence=False,
                quiet=True,
            )
            log(f"  {WORKLOAD}: {steps} steps, policy width {width}")
            result = asyncio.run(example.train(settings))
        add_figures(example, report, result, width)


def add_figures(example: Any, report: Report, result: Any, width: int) -> None:
    timed = result.records[1:] or result.records  # the first step pays one-time costs
    walls = [sum(r.seconds.values()) for r in timed]
    ledger = [example.ledger_seconds(r.seconds) for r in timed]
    policy = [example.policy_seconds(r.seconds) for r in timed]
    sessions = [example.sessions_recorded(r) for r in timed]
    label = f"width {width} ({result.parameters / 1e6:.2f}M parameters), {len(timed)} steps"
    # the spread of each is over the steps: the median step, the cheapest and the dearest
    report.add(
        WORKLOAD,
        f"ledger cost per session, median; {label}",
        median(example.ledger_ms_per_session(r) for r in timed),
        "ms",
    )
    report.add(
        WORKLOAD,
        f"ledger share of step time, median; {label}",
        median(100 * lg / wall for lg, wall in zip(ledger, walls)),
        "%",
        target=f"< {GOAL_PERCENT:g}%",
        goal=("<=", GOAL_PERCENT),
    )
    report.add(
        WORKLOAD,
        f"policy ms per session, median; {label}",
        median(1e3 * pol / max(1, n) for pol, n in zip(policy, sessions)),
        "ms",
    )
    report.add(WORKLOAD, f"ledger ms per step, median; {label}", 1e3 * median(ledger), "ms")
    report.add(WORKLOAD, f"policy ms per step, median; {label}", 1e3 * median(policy), "ms")
    report.add(WORKLOAD, f"step wall ms, median; {label}", 1e3 * median(walls), "ms")
    phases = sorted({k for r in timed for k in r.seconds if k.startswith("ledger/")})
    for phase in phases:
        report.add(
            WORKLOAD,
            f"{phase} ms per step, median; width {width}",
            1e3 * median(r.seconds.get(phase, 0.0) for r in timed),
            "ms",
        )
    report.note(
        WORKLOAD,
        f"width {width}: {statistics.fmean(sessions):.0f} sessions per step on average; over the "
        f"whole run the ledger {1e3 * sum(ledger) / sum(sessions):.2f} ms per session, the policy "
        f"{1e3 * sum(policy) / sum(sessions):.2f} ms per session",
    )
