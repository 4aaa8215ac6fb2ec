"""`/v1/responses` as a translation of chat completions (mt_grpo.agents.responses.py), checked against the OpenAI
Agents SDK's own code: the request is the one `OpenAIResponsesModel` builds for an Agent with a `function_tool`, its
messages and tools equal to what the SDK's own chat-completions path makes of the same items
(`chatcmpl_converter.Converter`); the reply is read by the SDK's `process_model_response` (the function calls it
runs, the text it ends on), and the streamed reply by the openai package's SSE parser (`AsyncStream`) and its own
event accumulator (`ResponseStreamState`, what `client.responses.stream` builds the final response with)."""

import asyncio
import json

import httpx
import pytest
from agents import Agent, ModelSettings, Usage, function_tool
from agents.items import ModelResponse
from agents.models.chatcmpl_converter import Converter
from agents.models.openai_responses import OpenAIResponsesModel
from agents.run_internal.turn_resolution import process_model_response
from openai import AsyncOpenAI, AsyncStream, omit
from openai._utils import is_given
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent

from mt_grpo.agents.responses import (ResponsesRequestError, chat_request, response_from_chat, sse,
                                           stream_events)


@function_tool
def population(city: str) -> str:
    """Look a city's population up.

    Args:
        city: The city's name.
    """
    return {"Oslo": "709000"}.get(city, "unknown")


AGENT = Agent(name="Assistant", instructions="Answer in one line.", tools=[population])
# A history as the SDK echoes it back after one call: the user's question, the assistant's message and call (our
# output items, with their ids and status), the tool's output
HISTORY = [{"role": "user", "content": "How many people live in Oslo?"},
           {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "I look it up.", "annotations": []}]},
           {"id": "fc_1_0", "type": "function_call", "call_id": "call_1", "name": "population",
            "arguments": '{"city": "Oslo"}', "status": "completed"},
           {"type": "function_call_output", "call_id": "call_1", "output": "709000"}]


def sdk_request(items, stream: bool, settings: ModelSettings | None = None) -> dict:
    """The body the SDK sends for AGENT with these input items: its create kwargs less what the openai client leaves
    out (omitted values) or sends as headers, through JSON as on the wire."""
    model = OpenAIResponsesModel(model="policy", openai_client=AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9"))
    kwargs = model._build_response_create_kwargs(AGENT.instructions, items, settings or ModelSettings(),
                                                  AGENT.tools, None, [], stream=stream)
    body = {key: value for key, value in kwargs.items()
            if is_given(value) and value is not None and not key.startswith("extra_")}
    return json.loads(json.dumps(body))


def chat_completion(content: str | None, calls: list[tuple[str, str, str]] = (), finish: str = "stop") -> dict:
    """A chat completion as the endpoint's chat path answers: the text, the parsed calls (id, name, arguments)."""
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                              for cid, name, args in calls] or None}
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1765000000, "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}}


def wire(response: Response) -> Response:
    return Response.model_validate(json.loads(response.model_dump_json(exclude_none=True)))


def sdk_processed(response: Response):
    return process_model_response(agent=AGENT, all_tools=AGENT.tools, output_schema=None, handoffs=[],
                                  response=ModelResponse(output=response.output, usage=Usage(),
                                                         response_id=response.id))


def parsed_stream(response: Response) -> list[ResponseStreamEvent]:
    """The SSE text of `response`, read by the openai package's own stream parser, as `client.responses.create(...,
    stream=True)` reads a server's."""
    text = "".join(sse(stream_events(response)))
    raw = httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"},
                         request=httpx.Request("POST", "http://127.0.0.1:9/v1/responses"))

    async def read():
        stream = AsyncStream(cast_to=ResponseStreamEvent, response=raw, client=AsyncOpenAI(api_key="k"))
        return [event async for event in stream]

    return asyncio.run(read())


# ---------------------------------------------------------------------------------------------------------------------
# Requests


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdks_request_becomes_the_messages_and_tools_of_its_own_chat_path(stream):
    body = sdk_request(HISTORY, stream)
    chat = chat_request(body)
    expected = [{"role": "system", "content": AGENT.instructions}] + Converter.items_to_messages(HISTORY)
    assert chat["messages"] == json.loads(json.dumps(expected))
    assert chat["tools"] == [Converter.tool_to_openai(population)]
    assert chat["model"] == "policy" and chat["stream"] is False  # the route streams the translated reply
    assert "tool_choice" not in chat and "parallel_tool_calls" not in chat  # the SDK's defaults send neither


def test_a_first_call_is_the_instructions_and_the_users_text():
    assert chat_request(sdk_request("How many people live in Oslo?", False))["messages"] == [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "How many people live in Oslo?"}]


def test_model_settings_reach_the_chat_fields():
    settings = ModelSettings(temperature=0.3, top_p=0.9, max_tokens=64, tool_choice="population",
                             parallel_tool_calls=False, store=False, metadata={"run": "a"}, include_usage=True)
    chat = chat_request(sdk_request(HISTORY, False, settings))
    assert (chat["temperature"], chat["top_p"], chat["max_tokens"], chat["parallel_tool_calls"]) == (0.3, 0.9, 64,
                                                                                                      False)
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "population"}}
    assert "store" not in chat and "metadata" not in chat
    assert chat_request({"input": "hi", "tool_choice": "required"})["tool_choice"] == "required"


def test_calls_without_a_message_and_content_parts_are_the_chat_paths_messages():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text",
                                                                                       "text": "brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Oslo and Bergen?"}]},
             {"type": "function_call", "call_id": "c1", "name": "population", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "population", "arguments": '{"city": "Bergen"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "709000"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "291000"}]}]
    messages = chat_request({"input": items})["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Be brief." and messages[4]["content"] == "291000"
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "population", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function", "function": {"name": "population", "arguments": '{"city": "Bergen"}'}}]}
    # the SDK's chat path makes the same two calls of one assistant message
    sdk = Converter.items_to_messages(items[1:])
    assert [c["id"] for c in sdk[1]["tool_calls"]] == ["c1", "c2"]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "logit_bias": {"1": 2}}, "logit_bias"),
    ({"instructions": "hi"}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "critic", "content": "no"}]}, "input[0].role"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(body, param):
    with pytest.raises(ResponsesRequestError) as raised:
        chat_request(body)
    assert raised.value.param == param


def test_fields_that_do_not_change_the_sample_are_accepted():
    body = {"input": "hi", "store": False, "metadata": {"a": "b"}, "user": "u",
            "include": ["message.input_image.image_url"],
            "truncation": "disabled", "reasoning": {"effort": "low"}, "service_tier": "auto", "prompt_cache_key": "k",
            "stream": True, "text": {"format": {"type": "text"}}, "background": False}
    assert chat_request(body) == {"messages": [{"role": "user", "content": "hi"}], "stream": False}


def test_a_json_schema_format_goes_on_to_the_chat_path_to_be_judged_there():
    fmt = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
    assert chat_request({"input": "hi", "text": {"format": fmt}})["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}


# ---------------------------------------------------------------------------------------------------------------------
# Replies


def test_a_reply_with_a_call_is_the_function_call_the_sdk_runs():
    completion = chat_completion("I look it up.", [("call_9", "population", '{"city": "Oslo"}')], "tool_calls")
    body = sdk_request(HISTORY[:1], False)
    response = wire(response_from_chat(completion, body))
    processed = sdk_processed(response)
    assert [(f.tool_call.call_id, f.tool_call.name, f.tool_call.arguments, f.function_tool.name)
            for f in processed.functions] == [("call_9", "population", '{"city": "Oslo"}', "population")]
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "I look it up." and response.status == "completed"
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (40, 12, 52)
    # echoed back as the SDK echoes output items, the reply is the assistant message the chat path returned
    echoed = HISTORY[:1] + [item.model_dump(exclude_none=True) for item in response.output]
    assert chat_request({"input": echoed})["messages"][1] == ChatCompletion.model_validate(
        completion).choices[0].message.model_dump(exclude_none=True, exclude={"refusal", "annotations"})


def test_a_reply_without_a_call_is_the_sdks_final_output():
    response = wire(response_from_chat(chat_completion("709,000 people."), sdk_request(HISTORY, False)))
    processed = sdk_processed(response)
    assert processed.functions == [] and not processed.has_tools_or_approvals_to_run()
    assert response.output_text == "709,000 people."
    assert [t.name for t in response.tools] == ["population"] and response.instructions == "Answer in one line."


def test_a_cut_reply_is_incomplete_for_max_output_tokens():
    response = wire(response_from_chat(chat_completion("709,0", finish="length"), {"input": "hi"}))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert parsed_stream(response)[-1].type == "response.incomplete"


@pytest.mark.parametrize("content, calls", [
    ("I look both up.", [("call_1", "population", '{"city": "Oslo"}'),
                         ("call_2", "population", '{"city": "Bergen"}')]),
    ("709,000 people.", []),
    (None, [("call_1", "population", '{"city": "Oslo"}')]),
])
def test_the_stream_is_the_response_as_openais_parser_and_accumulator_read_it(content, calls):
    response = response_from_chat(chat_completion(content, calls, "tool_calls" if calls else "stop"),
                                  sdk_request(HISTORY, True))
    events = parsed_stream(response)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response == wire(response)
    state = ResponseStreamState(input_tools=sdk_request(HISTORY, True)["tools"], text_format=omit)
    for event in events[:-1]:  # the snapshot the openai package builds from the added and delta events
        state.handle_event(event)
    snapshot = state._ResponseStreamState__current_snapshot
    assert [item.model_dump(exclude_none=True, exclude={"status"}) for item in snapshot.output] == [
        item.model_dump(exclude_none=True, exclude={"status"}) for item in response.output]
    state.handle_event(events[-1])  # and the final response it parses from the terminal event, arguments parsed
    assert [getattr(item, "parsed_arguments", None) for item in state._completed_response.output] == [
        json.loads(item.arguments) if item.type == "function_call" else None for item in response.output]
    # what Runner.run_streamed keeps of a turn: the items of the output_item.done events, and the terminal response
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done == list(wire(response).output)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == (content or "")
