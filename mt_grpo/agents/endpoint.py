"""The agents' OpenAI-compatible endpoint: every episode its own base URL and key, every call a sample recorded exactly.

Contract (what a route calls, the chat completions route here and a `/v1/responses` route beside it):

    session = endpoint.session(episode_id, authorization_header)       # APIError 401/409 when it may not call
    result = await endpoint.complete(session, messages, tools=None, tool_choice=None, retry_count=None, **fields)
        messages  the conversation in OpenAI's chat shape (system/user/assistant with tool_calls/tool with
                  tool_call_id; content a string or text parts)
        tools     OpenAI function tools [{"type": "function", "function": {name, description, parameters}}]
        retry_count  the openai SDK's `x-stainless-retry-count` header (None without one): a retry of the last call
                  gets that call's reply, never a sample of its own (is_retry)
        fields    the request's other fields: max_tokens / max_completion_tokens, n, temperature, top_p, stop,
                  logit_bias, response_format, presence/frequency_penalty, ... (refused where not exact: APIError 400)
        -> CallResult: content (str | None), tool_calls (OpenAI's [{id, type, function: {name, arguments}}]),
           finish_reason (stop | length | tool_calls), usage ({prompt_tokens, completion_tokens, total_tokens}),
           text (the sampled text as the model wrote it)

`complete` records the call on the episode (runner.AgentEnv reads it when the agent is done): when its messages extend
the previous call's (that call's messages, the assistant message returned, then tool/user/system messages), the
previous ids are kept and only the new tail is rendered (mask 0), as the built-in loop appends tool replies
(MultiTurnToolEnv.append_reply, whose `turn_samples` rule applies); otherwise (history rewritten, dropped or
reordered, tools changed) the call starts a new sample, rendered whole, as `turn_samples: per_model_turn` does. Text
from the agent is text from outside: never a control token (protocol.template_ids; an agent's system and assistant
messages are marked, protocol.mark_outside).

Why FastAPI on uvicorn: the OpenAI clients (openai, LangChain, smolagents, the Agents SDK) speak HTTP with server-sent
events; FastAPI (on Starlette) gives routing, JSON errors and streaming responses, uvicorn an asyncio server that
runs in a thread beside the trainer with no process to manage. Both are well kept, and mcp already brings uvicorn and
Starlette (the versions in requirements.txt).
"""

import asyncio
import concurrent.futures
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace

from mt_grpo.base.protocol import (ChatTemplateProtocol, content_text, mark_outside,
                                   tool_call_message)
from mt_grpo.rewards.conversation import failed
from mt_grpo.rollout.episodes import CallRecord, Episode, length_stop
from mt_grpo.rollout.toolset import Toolset
from mt_grpo.rollout.user_turns import add_model_message

logger = logging.getLogger("mt_grpo")

MODEL_NAME = "policy"  # what /v1/models lists; a request may name any model: the policy answers
# Fields that do not change the sample, accepted as real clients send them
HARMLESS = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "user", "metadata", "store",
            "parallel_tool_calls", "seed", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p",
            "logprobs", "top_logprobs", "service_level", "service_tier", "prompt_cache_key", "safety_identifier",
            "modalities", "reasoning_effort", "verbosity", "extra_body", "stop", "response_format", "logit_bias",
            "presence_penalty", "frequency_penalty", "functions", "function_call", "prediction", "audio",
            "web_search_options"}
_LOGGED: set = set()  # causes logged once a run


def log_once(cause: str, message: str, *args) -> None:
    if cause not in _LOGGED:
        _LOGGED.add(cause)
        logger.warning(message, *args)


class APIError(Exception):
    """An error the endpoint answers in OpenAI's shape: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
             409: "invalid_request_error", 408: "timeout", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def steps_spent(max_env_steps: int) -> APIError:
    """The answer to a call past the episode's environment steps, which the built-in loop would not run either."""
    return APIError(400, f"This episode has had its {max_env_steps} environment steps (max_env_steps): tool results "
                         "past them are not run, as in the built-in loop. End the episode.", param="max_env_steps",
                    code="max_env_steps")


@dataclass
class CallResult:
    content: str | None
    tool_calls: list[dict]
    finish_reason: str
    usage: dict
    text: str


@dataclass
class Session:
    """One episode's endpoint state. `sent`: the keys (message_key) of the conversation the last call ended with (its
    messages and the assistant message returned); a call whose messages start with it appends to the sample."""

    id: str
    key: str
    row: dict
    deadline: float
    index: int = 0  # the episode's place in its batch (a group's samples are asked for in order)
    ep: Episode | None = None
    sent: list = field(default_factory=list)
    tools_key: str = ""
    tool_names: dict = field(default_factory=dict)  # tool_call id -> the function's name
    returned: dict = field(default_factory=dict)  # message_key of an assistant message returned -> its sampled text
    ended: str = ""  # why the episode ended ("" while its agent runs): agent_done, agent_error, agent_timeout, ...
    last_stop: str = ""  # the stop reason the built-in loop would give after the last call (answer, no_action, ...)
    budget_spent: bool = False
    in_flight: concurrent.futures.Future | None = None
    last_call: tuple[str, concurrent.futures.Future] | None = None  # (the request, Future[CallResult]): its retries
    stats: Counter = field(default_factory=Counter)  # the counts of agents.AGENT_COUNTS (calls, retries, ...)
    lock: threading.Lock = field(default_factory=threading.Lock)


def message_key(m: dict) -> str:
    """What makes two messages the same turn: role, text, tool calls (name, parsed arguments), tool_call_id."""
    calls = [((c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments")))
             for c in m.get("tool_calls") or []]
    return json.dumps([m.get("role"), content_text(m.get("content") or ""), calls, m.get("tool_call_id") or ""],
                      sort_keys=True, default=str)


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


class Endpoint:
    """The HTTP server and the episodes it serves. `env`: the trainer's MultiTurnToolEnv (rendering, the protocol, the
    budget, append_reply); `sample(ids, max_tokens) -> Future[Sample]`: the generation (runner.AgentEnv sets it per
    rollout: a server's submit, or the in-process batcher); `max_prompt_length`: a first call's prompt past it is
    refused; `sampling`: the run's SamplingParams; `honour`: "run" | "exact" (agent_sampling)."""

    def __init__(self, env, *, host: str = "127.0.0.1", port: int = 0, max_prompt_length: int | None = None,
                 sampling=None, honour: str = "run"):
        self.env, self.max_prompt_length, self.sampling, self.honour = env, max_prompt_length, sampling, honour
        self.sessions: dict[str, Session] = {}
        self.sample = None  # set per rollout
        self.chat_template = isinstance(env.protocol, ChatTemplateProtocol)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = None
        self.thread = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- the server ---------------------------------------------------------------------------------
    def start(self, app) -> "Endpoint":
        """Serve `app` (routes.make_app(self): the routes import this module, never the other way) on the socket."""
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        started = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

        self.thread = threading.Thread(target=serve, name="agent-endpoint", daemon=True)
        self.thread.start()
        started.wait(30)
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        logger.info("Agent endpoint on http://%s:%d (one base URL and key per episode).", self.host, self.port)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(10)
            self.server = None

    def base_url(self, session: Session) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/episodes/{session.id}/v1"

    # -- episodes -----------------------------------------------------------------------------------
    def open(self, row: dict, timeout: float) -> Session:
        session = Session(id=uuid.uuid4().hex[:12], key="sk-mtgrpo-" + secrets.token_urlsafe(24), row=row,
                          deadline=time.monotonic() + timeout, index=len(self.sessions))
        self.sessions[session.id] = session
        return session

    def end(self, session: Session, reason: str) -> None:
        """The episode ends: later calls get 409; a call in flight is answered with an error."""
        with session.lock:
            session.ended = session.ended or reason
            in_flight = session.in_flight
        if in_flight is not None:  # outside the lock: answering it records it (Endpoint.answered)
            settle(in_flight, None, APIError(409, f"The episode ended ({session.ended}) while this call waited for "
                                                  "its sample.", code="episode_ended"))

    def forget(self, session: Session) -> None:
        """Keep only what answers a late call (its key, why it ended): the episode and the row go with the rollout."""
        self.sessions[session.id] = Session(id=session.id, key=session.key, row={}, deadline=0.0,
                                            ended=session.ended or "agent_done")

    def session(self, episode_id: str, authorization: str | None) -> Session:
        """The session a request may use: its key must be the episode's own, and the episode still running."""
        key = (authorization or "").removeprefix("Bearer ").strip()
        session = self.sessions.get(episode_id)
        if session is None or not secrets.compare_digest(session.key, key):
            raise APIError(401, "Incorrect API key for this episode's address: each episode has its own base URL "
                                "and key (OPENAI_BASE_URL, OPENAI_API_KEY).", code="invalid_api_key")
        if session.ended:
            raise APIError(409, f"This episode has ended ({session.ended}): its calls are closed.",
                           code="episode_ended")
        return session

    # -- one call -----------------------------------------------------------------------------------
    async def complete(self, session: Session, messages, tools=None, tool_choice=None, retry_count: int | None = None,
                       **fields) -> CallResult:
        """One model call of the episode (module docstring): checked, recorded, sampled, parsed. A retry of the last
        call (`is_retry`) gets that call's reply, never a sample of its own."""
        request, future = json.dumps([messages, tools, tool_choice, fields], sort_keys=True, default=str), None
        with session.lock:  # held for no await: a recording or an episode's end, a few milliseconds at most
            if is_retry(session.last_call, request, retry_count):
                session.stats["retries"] += 1
                result = session.last_call[1]
            else:
                if session.in_flight is not None:
                    raise APIError(409, "Another call of this episode is in flight: an episode's calls run one at a "
                                        "time.", code="call_in_flight")
                session.stats["calls"] += 1
                try:
                    ids, max_tokens = self.prepare(session, messages, tools, tool_choice, fields)
                except APIError:
                    session.stats["refused"] += 1
                    raise
                future = session.in_flight = self.sample(ids, max_tokens, session.index, not session.ep.completion_ids)
                result = concurrent.futures.Future()
                session.last_call = (request, result)
        if future is not None:  # outside the lock, which `answered` takes
            future.add_done_callback(lambda f: self.answered(session, f, result, len(ids), tool_choice,
                                                             fields.get("stop")))
        # shielded: a request the client gave up on (a timeout, a dropped connection) leaves the sample recorded, for
        # the client's retry to get
        return await asyncio.shield(asyncio.wrap_future(result))

    def answered(self, s: Session, sample: concurrent.futures.Future, result: concurrent.futures.Future,
                 prompt_tokens: int, tool_choice, stop) -> None:
        """The sample of the call in flight came: recorded, whether or not the request that asked for it still waits."""
        answer, error = None, sample.exception()
        with s.lock:
            s.in_flight = None
            if error is not None and not isinstance(error, APIError):  # the backend failed: the run stops there
                error = APIError(500, f"Sampling failed: {type(error).__name__}: {error}", code="sampling_failed")
            elif error is None and s.ended:
                error = APIError(409, f"The episode ended ({s.ended}) while this call waited for its sample.",
                                 code="episode_ended")
            elif error is None:
                try:
                    answer = self.record(s, sample.result(), prompt_tokens, tool_choice, stop)
                except Exception as e:  # noqa: BLE001 - answered to the request (and its retries)
                    error = e
        # outside the lock: the agent's next call may come as soon as this one is answered
        settle(result, answer, error)

    def prepare(self, s: Session, messages, tools, tool_choice, fields: dict) -> tuple[list[int], int]:
        """Check the request, append it to the episode (or start a new sample); the ids to sample from and the limit."""
        if s.ended:
            raise APIError(409, f"This episode has ended ({s.ended}): its calls are closed.", code="episode_ended")
        if s.last_stop == "max_env_steps":
            raise steps_spent(self.env.max_env_steps)
        if s.budget_spent:
            raise APIError(400, "This episode's token budget (max_completion_length) is spent: a reply was cut by it. "
                                "End the episode.", param="max_completion_length", code="budget_spent")
        self.check_fields(s, fields, tool_choice)
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise APIError(400, "`messages` must be a non-empty list of message objects.", param="messages")
        if messages[-1].get("role") == "assistant":
            raise APIError(400, "The last message is the assistant's: continuing a message is not supported; end "
                                "with a user, tool or system message.", param="messages")
        if tools is not None and (not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type") !=
                                                                     "function" for t in tools)):
            raise APIError(400, "`tools` must be a list of function tools ({type: function, function: {name, "
                                "parameters}}).", param="tools")
        canon = [self.canonical(s, m, k) for k, m in enumerate(messages)]
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        toolset = Toolset({}, (tools or None) if self.chat_template else None)
        env, ep = self.env, s.ep
        if ep is None:
            ids = env.render_ids(canon, True, toolset)
            if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
                raise APIError(400, f"The prompt is {len(ids)} tokens, past max_prompt_length "
                                    f"({self.max_prompt_length}).", param="messages", code="context_length_exceeded")
            s.ep = ep = Episode(ids, toolset=toolset, prompt_messages=canon)
        else:
            n, starts = len(s.sent), len(ep.sample_starts)
            tail = canon[n:]
            clean = keys[:n] == s.sent and tools_key == s.tools_key and tail and \
                all(m["role"] != "assistant" for m in tail)
            if clean:
                if any(m["role"] == "tool" for m in tail) and len({c.turn for c in ep.calls}) >= env.max_env_steps:
                    s.last_stop = "max_env_steps"  # the built-in loop runs no call past it
                    s.stats["past_max_env_steps"] += 1
                    raise steps_spent(env.max_env_steps)
                if not env.append_reply(ep, tail):
                    ep.stop_reason = ""  # the agent's end sets it (rollout: not before the agent returns)
                    s.budget_spent, s.last_stop = True, "budget"
                    raise APIError(400, "This call's new messages do not fit the episode's token budget "
                                        "(max_completion_length): the budget is spent. End the episode.",
                                   param="messages", code="budget_spent")
                if len(ep.sample_starts) > starts:
                    s.stats["new_samples/template"] += 1
                # the agent ran its tools: a reply in either failure form (ours, or TRL's {'error': ...}) failed
                ep.calls += [CallRecord(ep.tool_turns - 1, m["name"], {}, not failed(m), 0.0, m["content"])
                             for m in tail if m["role"] == "tool"]
            else:
                self.new_sample(s, ep, canon, toolset, "tools" if tools_key != s.tools_key else "rewrite")
        s.tools_key = tools_key
        s.sent = keys
        budget = self.env.budget(ep)
        asked = fields.get("max_completion_tokens", fields.get("max_tokens"))
        if budget < 1:
            s.budget_spent, s.last_stop = True, "budget"
            raise APIError(400, "This episode's token budget (max_completion_length) is spent. End the episode.",
                           param="max_completion_length", code="budget_spent")
        return list(ep.context_ids), min(budget, asked or budget)

    def new_sample(self, s: Session, ep: Episode, canon: list[dict], toolset: Toolset, why: str) -> None:
        """A call whose messages do not extend the last one's: its own sample, its prompt the render of its messages
        (environment tokens, as turn_samples' re-rendered prompts); ep.messages gets the messages after its last
        assistant message (the reply the model answers)."""
        last = max((k for k, m in enumerate(canon) if m["role"] == "assistant"), default=len(ep.prompt_messages) - 1)
        prompt = self.env.render_ids(canon, True, toolset)
        if len(prompt) - len(ep.prompt_ids) >= self.env.max_completion_length:
            s.budget_spent, s.last_stop = True, "budget"
            raise APIError(400, f"This call's messages do not extend the last call's ({why}), so they start a new "
                                f"sample whose prompt, the history re-rendered ({len(prompt)} tokens, "
                                f"{len(prompt) - len(ep.prompt_ids)} past the first prompt), counts against the "
                                f"episode's token budget, max_completion_length ({self.env.max_completion_length}): "
                                "the budget is spent. Raise max_completion_length, or send the history back as "
                                "returned (docs/guide.md, 'From an agent program').", param="messages",
                           code="budget_spent")
        s.stats[f"new_samples/{why}"] += 1
        ep.messages += canon[last + 1:]
        ep.sample_starts.append((len(ep.completion_ids), len(ep.messages)))
        ep.append("env", prompt)
        ep.toolset = toolset

    def check_fields(self, s: Session, f: dict, tool_choice) -> None:
        """Refuse what the sampler cannot honour exactly; override (and count) an agent's own sampling."""
        for name in ("max_tokens", "max_completion_tokens"):
            value = f.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise APIError(400, f"`{name}` must be a whole number of at least 1.", param=name)
        if f.get("n", 1) not in (1, None):
            raise APIError(400, "`n` must be 1: each call of an episode is one sample.", param="n")
        if f.get("logit_bias"):
            raise APIError(400, "`logit_bias` is not supported: the policy's samples are trained as drawn.",
                           param="logit_bias")
        fmt = f.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise APIError(400, "`response_format` other than text cannot be enforced by the sampler.",
                           param="response_format")
        for name in ("presence_penalty", "frequency_penalty"):
            if f.get(name):
                raise APIError(400, f"`{name}` is not supported: the run's sampling parameters apply.", param=name)
        stop = f.get("stop")
        if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and len(stop) <= 4 and
                                     all(isinstance(x, str) and x for x in stop)):
            raise APIError(400, "`stop` must be a string or a list of up to 4 strings.", param="stop")
        if f.get("functions") or f.get("function_call"):
            raise APIError(400, "`functions` is the deprecated form of `tools`: send `tools`.", param="functions")
        if tool_choice not in (None, "auto", "none"):  # smolagents' ToolCallingAgent sends `required` on every call
            named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
                isinstance((tool_choice.get("function") or {}).get("name"), str)
            if tool_choice != "required" and not named:
                raise APIError(400, "`tool_choice` must be auto, none, required or {type: function, function: "
                                    "{name}}.", param="tool_choice")
            s.stats["tool_choice_unenforced"] += 1
            log_once("tool_choice", "An agent asked for tool_choice %s: the policy's reply is returned as sampled, "
                     "with or without a call (the sampler cannot force one; counted in "
                     "agent/tool_choice_unenforced_per_episode).",
                     json.dumps(tool_choice))
        run = self.sampling
        for name in ("temperature", "top_p"):
            value = f.get(name)
            if value is None or run is None or float(value) == float(getattr(run, name)):
                continue
            if self.honour == "exact":
                raise APIError(400, f"`{name}` {value} differs from the run's ({getattr(run, name)}), and "
                                    "agent_sampling is exact: leave it out, or set the run's.", param=name)
            s.stats["sampling_overridden"] += 1
            log_once(f"sampling_{name}", "An agent asked for %s %s; the run's (%s) applies to every call, so that "
                     "the samples are the policy's (agent_sampling: exact refuses such calls instead; counted in "
                     "agent/sampling_overridden).", name, value, getattr(run, name))
        if unknown := sorted(set(f) - HARMLESS):
            log_once("fields:" + ",".join(unknown), "An agent's call holds fields this endpoint ignores: %s.", unknown)

    def canonical(self, s: Session, m: dict, k: int) -> dict:
        """An OpenAI message as the trainer's canonical message (protocol.py): an assistant message we returned is its
        sampled text; any other text is from outside (mark_outside), so no control token comes of it."""
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{k}].role is {role!r}: system, developer, user, assistant or tool.",
                           param=f"messages[{k}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise APIError(400, f"messages[{k}].content must be a string or a list of text parts.",
                           param=f"messages[{k}].content")
        text = content_text(content or "")
        if role == "tool":
            name = s.tool_names.get(m.get("tool_call_id")) or m.get("name") or ""
            return {"role": "tool", "name": name, "content": self.env.truncate_tool_output(text)}
        if role == "assistant":
            sampled = s.returned.get(message_key(m))
            if sampled is not None:
                return dict(sampled)
            calls = [((c.get("function") or {}).get("name", ""), _arguments((c.get("function") or {})
                                                                             .get("arguments")) or {})
                     for c in m.get("tool_calls") or []]
            written = "".join("\n" + self.call_text(name, args) for name, args in calls)
            message = {"role": "assistant", "content": text + written,
                       "tool_calls": [tool_call_message(name, args) for name, args in calls]}
            return mark_outside(message) if message["content"] else message
        message = {"role": role, "content": text}
        return mark_outside(message) if role == "system" and text else message

    def call_text(self, name: str, args) -> str:
        """An agent-written call as the model writes one (its protocol's format)."""
        if self.chat_template:
            return self.env.protocol.format_call(name, args)
        return self.env.protocol.call_text({"tool": name, "args": args, "thought": ""}).lstrip()

    def record(self, s: Session, sample, prompt_tokens: int, tool_choice, stop=None) -> CallResult:
        """Append the sample as sampled (ids, logprobs); its message, its calls, and the stop the built-in loop would
        give (record_model_turn's rules)."""
        ep, env = s.ep, self.env
        sample, before_stop = cut_at_stop(sample, [stop] if isinstance(stop, str) else stop or [], env.tokenizer)
        ep.append("model", sample.token_ids, sample.logprobs, sample.kept)
        sampled = env.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        text = sampled if before_stop is None else before_stop  # what the agent gets: no stop string, nothing after
        turn = env.protocol.parse(text)
        calls = [c for c in turn.calls if not c.error] if tool_choice != "none" else []
        add_model_message(ep, sampled, [tool_call_message(c.name, c.arguments) for c in calls])
        if turn.kind == "answer":
            s.last_stop = "answer"
        elif sample.finish_reason == "length":
            s.last_stop = length_stop(ep, turn, env.max_completion_length)
            s.budget_spent = s.last_stop == "budget"
        elif sample.finish_reason == "repetition":
            s.last_stop = "repetition"
        elif turn.kind == "none":
            s.last_stop = "no_action"
        else:
            s.last_stop = ""
        tool_calls = []
        for c in calls:
            call_id = f"call_{s.id}_{len(s.tool_names)}"
            s.tool_names[call_id] = c.name
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}})
        content = re.sub(r"\s*<tool_call>.*?(</tool_call>|$)", "", text, flags=re.DOTALL).strip() \
            if self.chat_template and calls else text
        finish = "length" if sample.finish_reason == "length" else "tool_calls" if tool_calls else "stop"
        returned = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
        s.returned[message_key(returned)] = ep.messages[-1]
        s.sent = s.sent + [message_key(returned)]
        n = len(sample.token_ids)
        return CallResult(content or None, tool_calls, finish,
                          {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n},
                          sampled)


def settle(future: concurrent.futures.Future, value, error: BaseException | None = None) -> None:
    """Answer `future` unless it was answered already (the episode ended while it waited)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def is_retry(last_call: tuple | None, request: str, retry_count: int | None) -> bool:
    """Whether a request is a retry of the episode's last call: the same request (messages, tools, fields) from a
    client that says it retries (the openai SDK's `x-stainless-retry-count` above 0, as the clients built on it send:
    the Agents SDK, LangChain, smolagents), or that says nothing of it. Its transport lost the reply (a timeout, a
    dropped connection), so the reply the endpoint recorded is the one the agent gets: a call is sampled once, however
    many times it is asked, and no sample the agent never received is trained. The same request from the openai SDK
    as a new call (retry count 0) is the agent asking again: a sample of its own."""
    return last_call is not None and last_call[0] == request and (retry_count is None or retry_count > 0)


def cut_at_stop(sample, stops: list[str], tokenizer):
    """`sample` up to the token that completes the first of `stops` in its text, as a sampler with those stop strings
    draws it (the tokens up to there have the same distribution; vLLM keeps that token too): the tokens after it are
    dropped, never trained. Returns (the sample, its text before the stop string), or (sample, None) without a stop."""
    for k in range(len(sample.token_ids) if stops else 0):
        text = tokenizer.decode(sample.token_ids[:k + 1], skip_special_tokens=True)
        found = [text.find(stop) for stop in stops if stop in text]
        if found:
            kept = None if sample.kept is None else sample.kept[:k + 1]
            return replace(sample, token_ids=sample.token_ids[:k + 1], logprobs=sample.logprobs[:k + 1], kept=kept,
                           finish_reason="stop"), text[:min(found)]
    return sample, None
