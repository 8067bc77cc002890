"""An agent written with the OpenAI Agents SDK, unmodified but for its base URL and key, runs a
tool-using conversation through the gateway: both model calls are recorded, and the session's
row is the conversation with the tool's result masked out (verl's tool-agent row)."""

from __future__ import annotations

import agents
import openai

from tests.gateway.conftest import identity, stack


@agents.function_tool
def add(a: int, b: int) -> str:
    """Add two numbers."""
    return str(a + b)


async def test_an_agents_sdk_agent_is_recorded_call_by_call(url: str) -> None:
    agents.set_tracing_disabled(True)  # nothing is sent anywhere but the gateway
    async with stack(url) as (gateway, standin):
        async with gateway.session("sdk", **identity()) as s:
            model = agents.OpenAIChatCompletionsModel(
                model="tool",
                openai_client=openai.AsyncOpenAI(
                    base_url=s.base_url, api_key=s.api_key, max_retries=0
                ),
            )
            agent = agents.Agent(name="adder", instructions="Add.", tools=[add], model=model)
            result = await agents.Runner.run(agent, "What is 2+2?")
            assert result.final_output == standin.answered[1]["text"]  # the model's last answer
            await s.post_reward(1.0)
        handle = await gateway.ledger.load_session("sdk")
        recorded = handle.view.recorded_calls()
        assert len(recorded) == len(standin.answered) == 2
        assert recorded[0].finish_reason == "tool_calls"
        assert handle.state == "succeeded"
        batch = await gateway.ledger.batch("train", 0, timeout=60)
        mask = batch["response_mask"][0]
        first, second = (len(a["response_ids"]) for a in standin.answered)
        tool_tokens = int(mask.numel()) - int(mask.sum())
        # answer 1 and answer 2 trainable; the tool's turn between them (and padding) masked
        assert int(mask.sum()) == first + second and tool_tokens > 0
        assert int(batch["num_turns"][0]) == 4  # verl's count: 2 model turns + 1 tool + 1
