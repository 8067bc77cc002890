"""The run the OpenTelemetry tests export: the demo's simulated agents, and a hand-made step of
sessions that record their model calls, with every ending a call and a session can have, and
text a terminal or a page would misread."""

from __future__ import annotations

from sessions import Ledger, SandboxError
from sessions.cli.demo import DemoConfig, run_demo

RUN = "otel-run"
#: The hand-made step (after the demo's steps 0 and 1).
CALL_STEP = 2
#: Text that would be markup in a page and control sequences in a terminal.
HOSTILE = "tool \x1b[31mred\x1b[0m <script>alert('x')</script> & \u202eevil\u202c \x07 end"
MODEL = "policy-7b"
#: The demo's configuration: no cancellations (a cancel 10 ms after scheduling can land before
#: the session exists on a loaded machine, leaving its group unsettled).
DEMO = DemoConfig(steps=2, prompts=3, group_size=2, fail_rate=0.4, cancel_rate=0.0, seed=11)


async def record_run(ledger: Ledger, *, start_step: int = 0) -> None:
    """The demo's steps, then the calls step; projected."""
    await run_demo(ledger, DEMO)
    await record_call_step(ledger)
    await ledger.project()


async def record_call_step(ledger: Ledger, step: int = CALL_STEP, prefix: str = "calls") -> None:
    """One group of five sessions that record their model calls:

    - `ok`: three recorded calls (the conversation grows), a reward, completed;
    - `call-failed`: a recorded call, a failed one, then the session fails (connection_error);
    - `incomplete`: a call started and never answered, then `complete`: failed closed;
    - `retried`: an attempt with one call fails and is retried, the second succeeds;
    - `sandbox`: a sandbox failure with hostile text in the message and in the call's text.
    """
    group = dict(
        uid=f"{prefix}-g",
        group_size=5,
        partition="train",
        global_step=step,
        runner="call-agent",
        data_source=HOSTILE,
    )
    sampling = {"model": MODEL, "temperature": 1.0}
    async with ledger.session(f"{prefix}-ok", session_index=0, **group) as s:
        prompt = [1, 2, 3, 4]
        for turn in range(3):
            call = await s.start_call(turn=turn, sampling=sampling, version=7)
            response = [10 + turn] * (turn + 2)
            await s.record_call(
                call,
                prompt_ids=prompt,
                response_ids=response,
                finish_reason="stop",
                min_version=7,
                latency_s=0.25,
                server="vllm-0",
                text=f"turn {turn}",
            )
            prompt = prompt + response + [99]  # the tool's answer before the next turn
        await s.post_reward(1.0, acc=1.0)

    s = await ledger.create_session(f"{prefix}-call-failed", session_index=1, **group)
    call = await s.start_call(sampling=sampling)
    await s.record_call(call, prompt_ids=[5, 6, 7], response_ids=[8, 9], finish_reason="length")
    call = await s.start_call(sampling=sampling)
    await s.fail_call(call, message="server closed the connection", error_type="ReadError")
    await s.fail("connection_error", message="the model server went away", error_type="ReadError")

    s = await ledger.create_session(f"{prefix}-incomplete", session_index=2, **group)
    await s.start_call(sampling=sampling)
    await s.complete()  # fails closed: incomplete_capture

    async with ledger.session(f"{prefix}-retried", session_index=3, **group) as s:
        call = await s.start_call(sampling=sampling)
        await s.record_call(call, prompt_ids=[1, 2], response_ids=[3, 4, 5])
        await s.retry("timeout", message="the first attempt hung")
        await s.start()
        call = await s.start_call(sampling=sampling)
        await s.record_call(call, prompt_ids=[1, 2], response_ids=[6], finish_reason="stop")
        await s.post_reward(0.5)

    s = await ledger.create_session(f"{prefix}-sandbox", session_index=4, **group)
    call = await s.start_call(sampling=sampling)
    await s.record_call(call, prompt_ids=[1], response_ids=[2, 3], text=HOSTILE)
    await s.fail_with(SandboxError(HOSTILE))
