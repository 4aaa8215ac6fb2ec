"""An agent written with smolagents as its docs write one: a `ToolCallingAgent` over `OpenAIServerModel`, a `@tool`,
`agent.run(task)`; the agent ends by calling its `final_answer` tool. The trainer calls `run` once per episode
(`agent: agent_programs.smolagents_tool_calling:run`, a sync function: it runs on a thread of its own) with the
episode's row, base URL and key."""

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

CAPITALS = {"Veltria": "Morvane", "Ostrand": "Kelsby", "Barvania": "Tirel"}


@tool
def capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's name.
    """
    return CAPITALS.get(country, f"No capital is known for {country}.")


def run(row: dict, base_url: str, api_key: str) -> float:
    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key)
    agent = ToolCallingAgent(tools=[capital], model=model, max_steps=3, verbosity_level=0)
    answer = agent.run(row["question"])
    return 1.0 if row["answer"] in str(answer) else 0.0
