"""OpenAI's Responses API (`POST /v1/responses`) as a translation of the endpoint's chat completions: the OpenAI Agents
SDK calls it by default (`OpenAIResponsesModel`; `Runner.run` without `stream`, `Runner.run_streamed` with `stream:
true`). Pure functions, no server: the endpoint's route turns a request into a chat request (`chat_request`), has it
sampled as any `/v1/chat/completions` call of the episode (so tokens, masks and history matching are the chat path's
own), and turns the chat completion back (`response_from_chat`, `stream_events` and `sse` for server-sent events).

What the Agents SDK 0.20 sends, and what becomes of it (its models/openai_responses.py, _build_response_create_kwargs):
- `instructions` -> the system message; `input` (a string, or items) -> messages: `message` items by role (developer
  is system), an assistant `message` and the `function_call` items after it -> one assistant message with its
  `tool_calls` (as the chat endpoint returned them, so a history the agent echoes back extends the sample),
  `function_call_output` -> a `tool` message;
- `tools` (function tools) -> chat tools; `tool_choice` -> its chat form; `max_output_tokens` -> `max_tokens`;
  `temperature`, `top_p`, `parallel_tool_calls`, `text.format` (-> `response_format`) go on to the chat path, which
  applies its own rules to them (the run's sampling, a format it cannot enforce refused);
- fields that do not change the sample (`include`, `store`, `metadata`, `user`, `truncation`, `reasoning`, ...) are
  accepted; what needs state the trainer does not keep (`previous_response_id`, `conversation`, a stored `prompt`,
  `item_reference`, `background`) or a tool it does not run (hosted tools: web search, files, computer) is refused
  with `ResponsesRequestError` naming the field, as OpenAI names an unknown parameter.

The reply: a `message` item with the text (when there is any) and a `function_call` item per tool call, `status`
`incomplete` with `incomplete_details.reason` `max_output_tokens` where the chat reply's `finish_reason` is `length`
(streamed: `response.incomplete` as the last event, which the SDK raises on, as it does against OpenAI).
"""

import json
import time
from typing import Any, Iterable, Iterator

from openai.types.chat import ChatCompletion
from openai.types.responses import (Response, ResponseCompletedEvent, ResponseContentPartAddedEvent,
                                    ResponseContentPartDoneEvent, ResponseCreatedEvent,
                                    ResponseFunctionCallArgumentsDeltaEvent, ResponseFunctionCallArgumentsDoneEvent,
                                    ResponseFunctionToolCall, ResponseIncompleteEvent, ResponseInProgressEvent,
                                    ResponseOutputItemAddedEvent, ResponseOutputItemDoneEvent, ResponseOutputMessage,
                                    ResponseOutputText, ResponseStreamEvent, ResponseTextDeltaEvent,
                                    ResponseTextDoneEvent, ResponseUsage)

# Request fields that go on to the chat path unchanged (it applies the run's sampling and limits to them)
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls")
# Request fields that do not change the sample: accepted and left out, as the chat path accepts `user`, `metadata`, ...
IGNORED = ("include", "store", "metadata", "user", "truncation", "reasoning", "service_tier", "prompt_cache_key",
           "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "stream_options", "top_logprobs",
           "moderation", "stream")
# Request fields that need what the trainer does not keep or do, with the reason given in the 400
REFUSED = {"previous_response_id": "responses are not stored: send the whole conversation in `input`",
           "conversation": "conversations are not stored: send the whole conversation in `input`",
           "prompt": "stored prompts are not available: send `instructions` and `input`",
           "background": "background responses are not supported",
           "max_tool_calls": "the trainer's budget limits a call, not a tool-call count",
           "context_management": "the history is the agent's: the trainer does not compact it"}
MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequestError(ValueError):
    """A request the endpoint answers with OpenAI's 400 `invalid_request_error`, naming the field (`param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


# ---------------------------------------------------------------------------------------------------------------------
# Request: Responses -> chat completions


def chat_request(body: dict) -> dict:
    """The chat-completions request a `/v1/responses` request stands for (never streamed: the route streams the
    translated reply). Raises ResponsesRequestError for what cannot be honoured exactly."""
    if not isinstance(body, dict):
        raise ResponsesRequestError("", "the request body must be a JSON object")
    known = set(PASSED) | set(IGNORED) | set(REFUSED) | {"input", "instructions", "tools", "tool_choice",
                                                         "max_output_tokens", "text"}
    for key in body:
        if key not in known:
            raise ResponsesRequestError(key, f"Unknown parameter: '{key}'.")
    for key, why in REFUSED.items():
        if body.get(key) not in (None, False):
            raise ResponsesRequestError(key, f"'{key}' is not supported by this endpoint: {why}.")
    if "input" not in body:
        raise ResponsesRequestError("input", "Missing required parameter: 'input'.")
    messages = input_messages(body["input"])
    if body.get("instructions") is not None:
        messages.insert(0, {"role": "system", "content": text_of(body["instructions"], "instructions")})
    chat = {"messages": messages, "stream": False}
    chat.update({key: body[key] for key in PASSED if body.get(key) is not None})
    if body.get("tools"):
        chat["tools"] = [chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = chat_response_format((body.get("text") or {}).get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def input_messages(items: str | list) -> list[dict]:
    """`input` as chat messages. An assistant message and the function calls that follow it are one assistant message
    (a `function_call` with no message before it starts one with no content), as the chat endpoint returned them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesRequestError("input", "'input' must be a string or a list of items")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesRequestError(where, f"'{where}' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = MESSAGE_ROLES.get(item.get("role"))
            if role is None:
                raise ResponsesRequestError(f"{where}.role", f"'{where}.role' must be one of {sorted(MESSAGE_ROLES)}")
            messages.append({"role": role, "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": text_of(item.get("output"), f"{where}.output")})
        else:  # reasoning, item_reference, hosted tools' calls: nothing the trainer sampled or can replay exactly
            raise ResponsesRequestError(f"{where}.type", f"input items of type '{kind}' are not supported by this "
                                        "endpoint (messages, function_call and function_call_output are)")
    return messages


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined (images and files refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesRequestError(where, f"'{where}' must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ResponsesRequestError(f"{where}[{j}]", f"content parts of type '{kind}' are not supported by this "
                                        "endpoint (text only)")
        texts.append(part.get("text", ""))
    return "".join(texts)


def chat_tool(tool: dict, where: str) -> dict:
    """A Responses function tool ({type, name, description, parameters, strict}) in the chat form."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ResponsesRequestError(f"{where}.type", f"tools of type '{kind}' are not supported by this endpoint: "
                                    "run the tool in the agent and declare it as a function tool")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    if tool.get("strict") is not None:  # as the SDK's own chat path passes it: the chat path judges it
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice  # auto | none | required, as in chat
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise ResponsesRequestError("tool_choice", f"a tool_choice of type '{kind}' is not supported by this endpoint "
                                "(auto, none, required or a function)")


def chat_response_format(fmt: dict | None) -> dict | None:
    """`text.format` as chat's `response_format` (None for plain text); the chat path decides what it can enforce."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


# ---------------------------------------------------------------------------------------------------------------------
# Reply: a chat completion -> a Response, whole or as server-sent events


def response_from_chat(completion: ChatCompletion | dict, body: dict) -> Response:
    """The Response a chat completion of `chat_request(body)` stands for: a message item with the reply's text (when
    there is any), then a function_call item per tool call (`call_id` the chat call's id, so that the agent's
    function_call_output answers it)."""
    completion = ChatCompletion.model_validate(completion) if isinstance(completion, dict) else completion
    choice = completion.choices[0]
    base = completion.id.removeprefix("chatcmpl-")
    output: list = []
    if choice.message.content:
        output.append(ResponseOutputMessage(
            id=f"msg_{base}", type="message", role="assistant", status="completed",
            content=[ResponseOutputText(type="output_text", text=choice.message.content, annotations=[])]))
    for k, call in enumerate(choice.message.tool_calls or []):
        output.append(ResponseFunctionToolCall(id=f"fc_{base}_{k}", type="function_call", call_id=call.id,
                                               name=call.function.name, arguments=call.function.arguments,
                                               status="completed"))
    cut = choice.finish_reason in ("length", "content_filter")
    usage = completion.usage
    return Response(
        id=f"resp_{base}", object="response", created_at=float(completion.created or int(time.time())),
        model=completion.model, output=output, status="incomplete" if cut else "completed",
        incomplete_details={"reason": "max_output_tokens" if choice.finish_reason == "length"
                            else "content_filter"} if cut else None,
        instructions=body.get("instructions"), tools=[tool for tool in body.get("tools") or []],
        tool_choice=body.get("tool_choice") or "auto", parallel_tool_calls=body.get("parallel_tool_calls", True),
        temperature=body.get("temperature"), top_p=body.get("top_p"),
        max_output_tokens=body.get("max_output_tokens"), metadata=body.get("metadata"),
        text=body.get("text") or {"format": {"type": "text"}},
        usage=None if usage is None else ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
            input_tokens_details={"cached_tokens": 0, "cache_write_tokens": 0},
            output_tokens_details={"reasoning_tokens": 0}))


def stream_events(response: Response) -> Iterator[ResponseStreamEvent]:
    """The events OpenAI streams for `response`, in its order: created, in_progress, per output item its added,
    deltas and done events, then completed (or incomplete). The reply is sampled whole before it is streamed, so each
    text and each call's arguments is one delta."""
    seq = iter(range(1 << 30))
    started = response.model_copy(update={"status": "in_progress", "output": [], "usage": None,
                                          "incomplete_details": None})
    yield ResponseCreatedEvent(type="response.created", sequence_number=next(seq), response=started)
    yield ResponseInProgressEvent(type="response.in_progress", sequence_number=next(seq), response=started)
    for index, item in enumerate(response.output):
        added = item.model_copy(update={"status": "in_progress"})
        if isinstance(item, ResponseOutputMessage):
            added = added.model_copy(update={"content": []})
            yield ResponseOutputItemAddedEvent(type="response.output_item.added", sequence_number=next(seq),
                                               output_index=index, item=added)
            for part_index, part in enumerate(item.content):
                ids = {"item_id": item.id, "output_index": index, "content_index": part_index}
                empty = part.model_copy(update={"text": ""})
                yield ResponseContentPartAddedEvent(type="response.content_part.added", sequence_number=next(seq),
                                                    part=empty, **ids)
                yield ResponseTextDeltaEvent(type="response.output_text.delta", sequence_number=next(seq),
                                             delta=part.text, logprobs=[], **ids)
                yield ResponseTextDoneEvent(type="response.output_text.done", sequence_number=next(seq),
                                            text=part.text, logprobs=[], **ids)
                yield ResponseContentPartDoneEvent(type="response.content_part.done", sequence_number=next(seq),
                                                   part=part, **ids)
        else:
            added = added.model_copy(update={"arguments": ""})
            yield ResponseOutputItemAddedEvent(type="response.output_item.added", sequence_number=next(seq),
                                               output_index=index, item=added)
            ids = {"item_id": item.id, "output_index": index}
            yield ResponseFunctionCallArgumentsDeltaEvent(type="response.function_call_arguments.delta",
                                                          sequence_number=next(seq), delta=item.arguments, **ids)
            yield ResponseFunctionCallArgumentsDoneEvent(type="response.function_call_arguments.done",
                                                         sequence_number=next(seq), name=item.name,
                                                         arguments=item.arguments, **ids)
        yield ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=next(seq),
                                          output_index=index, item=item)
    if response.status == "incomplete":
        yield ResponseIncompleteEvent(type="response.incomplete", sequence_number=next(seq), response=response)
    else:
        yield ResponseCompletedEvent(type="response.completed", sequence_number=next(seq), response=response)


def sse(events: Iterable[ResponseStreamEvent]) -> Iterator[str]:
    """Server-sent events as OpenAI writes them: `event: <type>` and `data: <json>` (no `[DONE]`: the Responses
    stream ends with its terminal event)."""
    for event in events:
        yield f"event: {event.type}\ndata: {json.dumps(event.model_dump(mode='json', exclude_none=True))}\n\n"
