"""(b) LangGraph as its docs build an agent by hand: a `StateGraph` over `MessagesState`, a model node with the
tools bound (`bind_tools`), a `ToolNode`, and `tools_condition` routing between them. The trainer calls
`run(row, base_url, api_key)` once per episode."""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from agent_programs.units import convert as convert_length


@tool
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length from one unit to another (meter, mile, foot, inch, kilometer)."""
    return convert_length(value, from_unit, to_unit)


def build(model):
    llm = model.bind_tools([convert])

    def call_model(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode([convert]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def run(row, base_url, api_key):
    app = build(ChatOpenAI(model="policy", base_url=base_url, api_key=api_key))
    state = app.invoke({"messages": [("user", row["question"])]}, {"recursion_limit": 10})
    return row["answer"] in state["messages"][-1].content  # a bool: the reward 1.0 or 0.0
