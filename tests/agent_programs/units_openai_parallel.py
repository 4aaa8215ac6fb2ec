"""(a) The openai SDK as its docs write a tool loop with `client.chat.completions.create`: the tools as JSON schema,
every call of a reply run (parallel tool calls), their results appended as tool messages, until a reply without
calls. The trainer calls `run(row, client)` once per episode."""

import json

from agent_programs.units import convert

TOOLS = [{"type": "function", "function": {
    "name": "convert", "description": "Convert a length from one unit to another.",
    "parameters": {"type": "object", "properties": {"value": {"type": "number"}, "from_unit": {"type": "string"},
                                                    "to_unit": {"type": "string"}},
                   "required": ["value", "from_unit", "to_unit"]}}}]


def run(row, client):
    messages = [{"role": "system", "content": "You convert units. Use the convert tool."},
                {"role": "user", "content": row["question"]}]
    for _ in range(5):
        response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                  parallel_tool_calls=True)
        message = response.choices[0].message
        messages.append(message)  # the SDK's message object, as its docs append it
        if not message.tool_calls:
            return 1.0 if row["answer"] in (message.content or "") else 0.0
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": convert(**args)})
    return 0.0
