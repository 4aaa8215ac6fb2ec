"""An agent written with the OpenAI Agents SDK as its docs write one (Agent, Runner, function_tool; the default model
and model settings; the default client, which reads OPENAI_BASE_URL and OPENAI_API_KEY; tracing off with
set_tracing_disabled, as the SDK's tracing docs say for a run without an OpenAI key). The trainer runs it once per
episode as `agent_command: python tests/agent_programs/openai_agents_sdk.py` (`--stream`: Runner.run_streamed) with
the episode's base URL and key in the environment and its row in MT_GRPO_ROW; the last line it prints is the
episode's reward. `run` is the same agent in process."""

import asyncio
import json
import os
import sys

from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)

CAPITALS = {"Veltria": "Morvane", "Ostrand": "Kelsby", "Barvania": "Tirel"}


@function_tool
def capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's name.
    """
    return CAPITALS.get(country, f"No capital is known for {country}.")


agent = Agent(name="Geographer", instructions="Answer with the capital city. Look it up with the capital tool first.",
              tools=[capital])


async def run(row: dict, base_url: str, api_key: str) -> float:
    """In process (`agent: agent_programs.openai_agents_sdk:run`): the episode's own address through a model provider,
    as the SDK's docs give another endpoint to one run (the environment is shared by every episode of the process)."""
    config = RunConfig(model_provider=OpenAIProvider(base_url=base_url, api_key=api_key))
    result = await Runner.run(agent, row["question"], run_config=config)
    return 1.0 if row["answer"] in result.final_output else 0.0


async def main() -> None:
    row = json.loads(os.environ["MT_GRPO_ROW"])
    if "--stream" in sys.argv:
        result = Runner.run_streamed(agent, row["question"])
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, row["question"])
    print(json.dumps({"reward": 1.0 if row["answer"] in result.final_output else 0.0}))


if __name__ == "__main__":
    asyncio.run(main())
