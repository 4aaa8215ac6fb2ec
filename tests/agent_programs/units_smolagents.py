"""(c) smolagents as its guided tour writes a tool-calling agent: a `@tool` function with typed arguments and an
`Args:` docstring, a `ToolCallingAgent` over `OpenAIServerModel`, `agent.run(task)`. The trainer calls
`run(row, base_url, api_key)` once per episode (a sync function: on a thread of its own)."""

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from agent_programs.units import convert as convert_length


@tool
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length from one unit to another.

    Args:
        value: The length in `from_unit`.
        from_unit: The unit it is given in: meter, mile, foot, inch or kilometer.
        to_unit: The unit to give it in.
    """
    return convert_length(value, from_unit, to_unit)


def run(row, base_url, api_key):
    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key)
    agent = ToolCallingAgent(tools=[convert], model=model, max_steps=3, verbosity_level=0)
    return float(row["answer"] in str(agent.run(row["question"])))
