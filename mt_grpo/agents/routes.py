"""The endpoint's HTTP routes (FastAPI): `/episodes/<id>/v1/chat/completions` and `/v1/responses` (responses.py's
translation), non-streaming and server-sent events, and `/v1/models`; every error in OpenAI's shape. Each route checks the episode's key (Endpoint.session) and calls
Endpoint.complete (endpoint.py's contract)."""

import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mt_grpo.agents import responses
from mt_grpo.agents.endpoint import MODEL_NAME, APIError, CallResult, Endpoint


def make_app(endpoint: Endpoint) -> FastAPI:
    app = FastAPI(title="mt-grpo agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def one_request_a_connection(request: Request, call_next):
        # Connection: close: a client that writes a request in two segments without TCP_NODELAY (httpx's sync
        # transport) waits for the delayed ACK of the first, 40 ms a call on a reused connection; a fresh loopback
        # connection costs a fraction of a millisecond (studies/agent_endpoint_cost.py)
        response = await call_next(request)
        response.headers["Connection"] = "close"
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "mt-grpo"}]}

    @app.get("/v1/models")
    async def list_models():
        return models()

    @app.get("/episodes/{episode_id}/v1/models")
    async def episode_models(episode_id: str, request: Request):
        endpoint.session(episode_id, request.headers.get("authorization"))
        return models()

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat_completions(episode_id: str, request: Request):
        session = endpoint.session(episode_id, request.headers.get("authorization"))
        body = await json_body(request)
        fields = {k: v for k, v in body.items() if k not in ("messages", "tools", "tool_choice", "stream")}
        result = await endpoint.complete(session, body.get("messages"), body.get("tools"), body.get("tool_choice"),
                                         retry_count(request), **fields)
        model = body.get("model") or MODEL_NAME
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(sse(chunks(result, model, usage)), media_type="text/event-stream")
        return completion(result, model)

    @app.post("/episodes/{episode_id}/v1/responses")
    async def create_response(episode_id: str, request: Request):
        session = endpoint.session(episode_id, request.headers.get("authorization"))
        body = await json_body(request)
        try:
            chat = responses.chat_request(body)
        except responses.ResponsesRequestError as e:
            session.stats.update(["calls", "refused"])  # as complete() counts a call it refuses
            raise APIError(400, e.message, param=e.param) from None
        fields = {k: v for k, v in chat.items() if k not in ("messages", "tools", "tool_choice", "stream")}
        result = await endpoint.complete(session, chat["messages"], chat.get("tools"), chat.get("tool_choice"),
                                         retry_count(request), **fields)
        response = responses.response_from_chat(completion(result, body.get("model") or MODEL_NAME), body)
        if body.get("stream"):
            return StreamingResponse(lines(responses.sse(responses.stream_events(response))),
                                     media_type="text/event-stream")
        return response.model_dump(mode="json", exclude_none=True)

    return app


def retry_count(request: Request) -> int | None:
    """The openai SDK's count of the times it has retried this request (`x-stainless-retry-count`), None without one."""
    value = request.headers.get("x-stainless-retry-count")
    return int(value) if value is not None and value.isdigit() else None


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}.", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", param="body")
    return body


def completion(r: CallResult, model: str) -> dict:
    """OpenAI's chat.completion object."""
    message = {"role": "assistant", "content": r.content, "refusal": None}
    if r.tool_calls:
        message["tool_calls"] = r.tool_calls
    return {"id": "chatcmpl-" + r.tool_calls[0]["id"] if r.tool_calls else f"chatcmpl-{time.time_ns()}",
            "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": r.finish_reason, "logprobs": None}],
            "usage": r.usage}


def chunks(r: CallResult, model: str, usage: bool) -> list[dict]:
    """The call as OpenAI streams it (chat.completion.chunk): the role, the content, each tool call, the finish reason,
    and the usage when `stream_options.include_usage`. The sample is whole before the first chunk."""
    base = {"id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    delta = lambda d, finish=None: {**base, "choices": [{"index": 0, "delta": d, "finish_reason": finish,  # noqa
                                                         "logprobs": None}]}
    out = [delta({"role": "assistant", "content": ""})]
    if r.content:
        out.append(delta({"content": r.content}))
    for i, call in enumerate(r.tool_calls):
        out.append(delta({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": call["function"]["arguments"]}}]}))
    out.append(delta({}, r.finish_reason))
    if usage:
        out.append({**base, "choices": [], "usage": r.usage})
    return out


async def lines(texts):
    for text in texts:
        yield text


async def sse(events: list[dict]):
    for event in events:
        yield f"data: {json.dumps(event)}\n\n"
    yield "data: [DONE]\n\n"
