"""Which group slot the running agent loop fills, from verl's own fields (docs/design.md §13).

verl 0.9.1 hands an agent loop the sample's dataset fields (``uid``, ``data_source``,
``raw_prompt``, ...) but not what its ``AgentLoopWorker`` knows about the sample: the
trajectory info (global step, sample index, rollout number, ``validate``) is an argument of the
worker's ``_run_agent_loop`` only, and so is the worker itself (whose reward handles score the
output). While an agent loop's ``run`` executes, the worker's ``_run_agent_loop`` call that awaits it is
a caller of it on the running task's stack of coroutine frames (``generate_sequences`` in V0 and
``AgentLoopWorkerTQ._run_prompt`` in V1 both run each sample so), so the agent loop reads them
from that frame, after checking that the frame is running this very agent-loop object.

The slot: partition ``val`` when verl validates, else ``train``; the global step (verl's ``-1``,
"no step", is None); the group size from the rollout config (``val_kwargs.n`` when validating,
else ``n``); the session index from

* V1: ``session_id``, the rollout number ``_run_prompt`` gives each of a prompt's n runs;
* V0: ``priority % n``. ``AgentLoopManager`` numbers the whole batch (``priority``) before
  splitting it between its workers, and the batch is the prompts repeated n times in place, so
  that is the rollout number across workers too. verl's own ``rollout_n`` counts within one
  worker's chunk, and a group split between two workers would get 0, 1 twice; it is used only
  when there is no ``priority`` (a worker driven directly).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from sessions.errors import UsageError

__all__ = ["VerlSample", "running_sample"]

_RUN_AGENT_LOOP = "_run_agent_loop"


@dataclass(frozen=True)
class VerlSample:
    """One agent-loop run as a ledger session slot, and the verl worker that runs it."""

    worker: Any
    uid: str
    session_index: int
    group_size: int
    partition: str
    global_step: int | None
    sample_index: int | None
    data_source: str | None
    validate: bool


def _int_or_none(value: Any) -> int | None:
    """A step or index as an int (numpy and 0-d tensors included); None when it is not one."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            return None
        if not as_float.is_integer():
            return None
        value = int(as_float)
    return value


def _verl_frame(agent_loop: object) -> dict[str, Any]:
    """The locals of the ``_run_agent_loop`` call that is running ``agent_loop``: a caller of this
    call on the stack of coroutine frames the running task is executing (Ray's actor methods wrap
    it in a tracing coroutine of their own, so it need not be the task's outermost one)."""
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == _RUN_AGENT_LOOP
            and frame.f_locals.get("agent_loop") is agent_loop
        ):
            return frame.f_locals
        frame = frame.f_back
    raise UsageError(
        "the ledger agent loop runs inside verl's AgentLoopWorker (generate_sequences, or V1's "
        "AgentLoopWorkerTQ), and none is running it here (verl changed how _run_agent_loop calls "
        "agent loops? this adapter is written against verl 0.9.1); register it through "
        "actor_rollout_ref.rollout.agent.agent_loop_config_path instead of calling its run() yourself"
    )


def running_sample(agent_loop: object, kwargs: dict[str, Any]) -> VerlSample:
    """The slot of the sample ``agent_loop`` is running, with ``kwargs`` its dataset fields."""
    local = _verl_frame(agent_loop)
    worker, trajectory = local["self"], local["trajectory"]
    validate = bool(trajectory.get("validate", False))
    rollout = worker.config.actor_rollout_ref.rollout
    group_size = int(rollout.val_kwargs.n if validate else rollout.n)
    if "session_id" in kwargs:  # V1: _run_prompt numbers a prompt's runs itself
        session_index = _int_or_none(kwargs["session_id"])
        step = _int_or_none(kwargs.get("global_steps", trajectory.get("step")))
    else:
        priority = _int_or_none(kwargs.get("priority"))
        session_index = (
            priority % group_size
            if priority is not None
            else _int_or_none(trajectory.get("rollout_n"))
        )
        step = _int_or_none(trajectory.get("step"))
    if session_index is None:
        raise UsageError(
            f"cannot tell which of the {group_size} runs of uid {kwargs.get('uid')!r} this is "
            "(no session_id, priority or rollout_n from verl)"
        )
    if "uid" not in kwargs:
        raise UsageError(
            "the batch has no 'uid' column; verl's trainers add one per prompt, a direct "
            "generate_sequences call must too (the ledger groups a prompt's runs by it)"
        )
    data_source = kwargs.get("data_source")
    return VerlSample(
        worker=worker,
        uid=str(kwargs["uid"]),
        session_index=session_index,
        group_size=group_size,
        partition="val" if validate else "train",
        global_step=step if step is not None and step >= 0 else None,
        sample_index=_int_or_none(trajectory.get("sample_index")),
        data_source=None if data_source is None else str(data_source),
        validate=validate,
    )
