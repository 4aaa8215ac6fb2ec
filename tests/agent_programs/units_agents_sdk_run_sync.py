"""(d) The OpenAI Agents SDK with two tools and `Runner.run_sync`, as its quickstart writes a synchronous run; the
episode's address through the run's model provider. The trainer calls `run(row, base_url, api_key)` once per
episode (a sync function: on a thread of its own)."""

from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool, set_tracing_disabled

from agent_programs.units import TO_METERS, convert as convert_length

set_tracing_disabled(True)


@function_tool
def list_units() -> str:
    """The length units the converter knows."""
    return ", ".join(sorted(TO_METERS))


@function_tool
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length from one unit to another.

    Args:
        value: The length in `from_unit`.
        from_unit: The unit it is given in.
        to_unit: The unit to give it in.
    """
    return convert_length(value, from_unit, to_unit)


agent = Agent(name="Converter", instructions="Convert lengths with the tools; answer with the number.",
              tools=[list_units, convert])


def run(row, base_url, api_key):
    config = RunConfig(model_provider=OpenAIProvider(base_url=base_url, api_key=api_key))
    result = Runner.run_sync(agent, row["question"], run_config=config, max_turns=4)
    return 1.0 if row["answer"] in result.final_output else 0.0
