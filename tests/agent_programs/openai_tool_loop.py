"""The built-in loop's turns written as an openai-SDK tool loop against the agent endpoint: the row's prompt, then up
to `turns` calls, each tool call answered by `tool`. tests/test_agent_endpoint.py checks that its episodes are the
built-in loop's, token for token; studies/agent_endpoint_cost.py times it against that loop."""

import json


def tool_loop(tool, turns: int = 3):
    def agent(row, client):
        messages = [{k: v for k, v in m.items() if k in ("role", "content")} for m in row["prompt"]]
        for _ in range(turns):
            m = client.chat.completions.create(model="policy", messages=messages).choices[0].message
            messages.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                return None
            for c in m.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": tool(**json.loads(c.function.arguments))})

    return agent
