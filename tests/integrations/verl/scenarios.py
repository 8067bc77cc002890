"""Steps recorded through the public API for the verl integration tests, and hypothesis plans.

A plan is a list of groups, a group a list of session outcomes (its length is the group size):

* ``("ok", rows, reward)``: ``rows`` trajectories (trajectory selection ``all`` keeps them all),
  the reward posted; recorded through ``Ledger.run_session`` or ``Ledger.session`` alternately;
* ``("error",)``: the runner raises ``RuntimeError`` (``runner_error``, a placeholder);
* ``("sandbox",)``: ``SandboxError`` (``sandbox_error``): dropped from train by ``POLICY``;
* ``("timeout",)``: ``run_session`` times the runner out (``timeout``, a placeholder);
* ``("cancel",)``: cancelled inside ``Ledger.session`` (no row).

Each example records into its own run of one database, so a module-scoped database serves
many examples without being emptied.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import sys
import types
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from hypothesis import strategies as st

from sessions import Ledger, PlaceholderPolicy, SandboxError

POLICY = PlaceholderPolicy(rules={"train": {"sandbox_error": "drop"}})
DATA_SOURCES = ("gsm8k", "swe-lite")
Outcome = tuple[Any, ...]
Plan = list[list[Outcome]]

_runs = itertools.count()


def new_run(prefix: str = "v") -> str:
    return f"{prefix}{next(_runs)}"


def _tokens(session_id: str, row: int) -> dict[str, np.ndarray]:
    """Deterministic, varied token arrays for one trajectory (context tokens masked out)."""
    rng = np.random.default_rng(zlib.crc32(f"{session_id}/{row}".encode()))
    prompt = rng.integers(1, 1000, int(rng.integers(1, 9)))
    response_len = int(rng.integers(1, 12))
    mask = (rng.random(response_len) < 0.8).astype(np.uint8)
    mask[0] = 1
    return {
        "prompt_ids": prompt,
        "response_ids": rng.integers(1, 1000, response_len),
        "response_mask": mask,
        "response_logprobs": -rng.exponential(0.5, response_len).astype(np.float32),
    }


async def _succeed(handle: Any, session_id: str, rows: int, reward: float) -> None:
    for row in range(rows):
        await handle.record_trajectory(**_tokens(session_id, row), num_turns=row + 1)
    await handle.post_reward(reward)


async def _one(ledger: Ledger, k: int, outcome: Outcome, identity: dict[str, Any]) -> None:
    session_id = (
        f"{identity['run']}-{identity['partition']}{identity['global_step']}-{identity['uid']}-s{k}"
    )
    kind = outcome[0]
    if kind == "ok" and k % 2 == 0:
        result = await ledger.run_session(
            lambda h: _succeed(h, session_id, outcome[1], outcome[2]), session_id, **identity
        )
        assert result.succeeded, result
    elif kind == "timeout":
        result = await ledger.run_session(
            lambda h: asyncio.sleep(5), session_id, timeout=0.02, **identity
        )
        assert result.failure_reason == "timeout", result
    else:
        raised: dict[str, type[BaseException]] = {
            "error": RuntimeError,
            "sandbox": SandboxError,
            "cancel": asyncio.CancelledError,
        }
        try:
            async with ledger.session(session_id, **identity) as handle:
                if kind == "ok":
                    await _succeed(handle, session_id, outcome[1], outcome[2])
                    return
                await handle.record_trajectory(
                    **_tokens(session_id, 0)
                )  # partial work, then the failure
                raise raised[kind](f"injected {kind}")
        except (RuntimeError, SandboxError, asyncio.CancelledError) as error:
            if not isinstance(error, raised.get(kind, ())):
                raise


async def record_step(ledger: Ledger, run: str, partition: str, step: int, plan: Plan) -> None:
    """Record every session of the plan for one (run, partition, step), concurrently."""
    jobs = []
    for g, group in enumerate(plan):
        uid = f"{run}-{partition}{step}-g{g}"
        for k, outcome in enumerate(group):
            identity = {
                "run": run,
                "uid": uid,
                "session_index": k,
                "group_size": len(group),
                "partition": partition,
                "global_step": step,
                "data_source": DATA_SOURCES[g % 2],
            }
            jobs.append(_one(ledger, k, outcome, identity))
    await asyncio.gather(*jobs)


async def recorded_batches(
    url: str, run: str, plans: Sequence[tuple[str, int, Plan]]
) -> tuple[list[Any], list[Any]]:
    """Record each (partition, step, plan); return their batches and their ledger metrics."""
    async with Ledger.open(url, run=run, placeholder_policy=POLICY) as ledger:
        for partition, step, plan in plans:
            await record_step(ledger, run, partition, step, plan)
        batches = [await ledger.batch(partition, step, timeout=30) for partition, step, _ in plans]
        metrics = [await ledger.metrics(partition, step) for partition, step, _ in plans]
    return batches, metrics


def ledger_figure(metrics: Sequence[Any], name: str) -> float:
    """A metric of the all-data-sources scope (data_source None)."""
    values = [m.value for m in metrics if m.metric == name and m.data_source is None]
    assert len(values) == 1, (name, values)
    return float(values[0])


# ---------------------------------------------------------------- hypothesis plans
OUTCOMES = st.one_of(
    st.tuples(st.just("ok"), st.integers(1, 3), st.sampled_from([0.0, 1.0, 0.5, 0.25])),
    st.tuples(st.sampled_from(["error", "sandbox", "timeout", "cancel"])),
)


@st.composite
def plans(draw: st.DrawFn, max_groups: int = 4) -> Plan:
    """1..max_groups groups of 1..4 sessions; at least one session succeeds with one row."""
    groups = draw(
        st.lists(st.lists(OUTCOMES, min_size=1, max_size=4), min_size=1, max_size=max_groups)
    )
    groups[0][0] = ("ok", 1, draw(st.sampled_from([0.0, 1.0])))
    return groups


def demo_like_plan(
    groups: int,
    group_size: int,
    *,
    cancelled: int,
    seed: int,
    failure_kinds: Sequence[str] = ("error", "timeout"),
    max_rows: int = 1,
) -> Plan:
    """A demo-like step: ~20 % failures of ``failure_kinds``, then ``cancelled`` of the succeeding
    sessions cancelled instead (no row). With the default kinds and one row per session, a train
    batch has ``groups x group_size - cancelled`` rows."""
    rng = np.random.default_rng(seed)
    plan: Plan = []
    for _ in range(groups):
        group: list[Outcome] = []
        for _ in range(group_size):
            if rng.random() < 0.2:
                group.append((failure_kinds[int(rng.integers(len(failure_kinds)))],))
            else:
                group.append(("ok", int(rng.integers(1, max_rows + 1)), float(rng.random() < 0.5)))
        plan.append(group)
    succeeding = [(g, k) for g in range(groups) for k in range(group_size) if plan[g][k][0] == "ok"]
    for index in rng.choice(len(succeeding), size=cancelled, replace=False):
        g, k = succeeding[int(index)]
        plan[g][k] = ("cancel",)
    return plan


def verl_v1_utils() -> Any:
    """``verl.trainer.ppo.v1.utils`` (where V1's GRPO-from-last-rows lives).

    verl's ``v1`` package imports TransferQueue in its ``__init__`` and in ``replay_buffer``, from
    which ``utils`` takes one string constant. Where TransferQueue is not installed, verl's own
    ``utils.py`` is loaded by path with that one name stubbed (the functions tested do not use it);
    the stubs leave ``sys.modules`` afterwards.
    """
    try:
        from verl.trainer.ppo.v1 import utils

        return utils
    except ModuleNotFoundError as error:
        if error.name != "transfer_queue":
            raise
    import verl.trainer.ppo as ppo

    folder = Path(ppo.__file__).parent / "v1"
    package, buffer = "verl.trainer.ppo.v1", "verl.trainer.ppo.v1.replay_buffer"
    stubs = {package: types.ModuleType(package), buffer: types.ModuleType(buffer)}
    stubs[package].__path__ = [str(folder)]  # type: ignore[attr-defined]
    stubs[buffer].DAPO_FILTERED_REWARD_COUNTS_KEY = "stub: unused by the functions tested"  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(
            "verl_v1_utils_for_tests", folder / "utils.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
