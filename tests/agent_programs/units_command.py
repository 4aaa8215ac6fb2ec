"""(e) An agent in another process (`agent_command: python tests/agent_programs/units_command.py`): the openai SDK's
default client, which reads OPENAI_BASE_URL and OPENAI_API_KEY, its row from MT_GRPO_ROW, its reward printed as its
last line."""

import json
import os
import sys

from openai import OpenAI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from agent_programs.units import convert  # noqa: E402

row = json.loads(os.environ["MT_GRPO_ROW"])
client = OpenAI()
messages = [{"role": "user", "content": row["question"]}]
tools = [{"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "properties": {"value": {"type": "number"}, "from_unit": {"type": "string"},
                                     "to_unit": {"type": "string"}}}}}]
reply = None
for _ in range(4):
    reply = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if not reply.tool_calls:
        break
    for call in reply.tool_calls:
        result = convert(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
print("converted", file=sys.stderr)
print(json.dumps({"reward": float(row["answer"] in (reply.content or ""))}))
