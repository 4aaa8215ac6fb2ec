"""An agent written with LangGraph as its docs write one: the prebuilt ReAct agent (`create_react_agent`) over
langchain-openai's `ChatOpenAI`, a `@tool`, `ainvoke` with the user's message. The trainer calls `run` once per episode
(`agent: agent_programs.langgraph_react:run`) with the episode's row, base URL and key."""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

CAPITALS = {"Veltria": "Morvane", "Ostrand": "Kelsby", "Barvania": "Tirel"}


@tool
def capital(country: str) -> str:
    """Look up the capital city of a country."""
    return CAPITALS.get(country, f"No capital is known for {country}.")


async def run(row: dict, base_url: str, api_key: str) -> float:
    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key)
    agent = create_react_agent(model, [capital], prompt="Answer with the capital city. Look it up with the capital "
                               "tool first.")
    result = await agent.ainvoke({"messages": [{"role": "user", "content": row["question"]}]})
    return 1.0 if row["answer"] in result["messages"][-1].content else 0.0
