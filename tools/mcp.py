"""MCP servers as agent tools: every tool of every server in the recipe's `mcp_servers`, as a plain function.

    from tools.mcp import mcp_tools
    tools = mcp_tools(["python tools/kb_mcp_server.py --seed 0", "http://127.0.0.1:8765/mcp"], timeout=10.0)
    # (a leading `python` runs with this interpreter; start the HTTP one first:
    #  .venv/bin/python tools/kb_mcp_server.py --transport http --port 8765)
    tools[0](query="capital of Ratomora")  # the server's text; an error result raises with the server's text

A server is a stdio command line (split like a shell would) or the URL of a streamable-HTTP server, or a dict
{"command": [...], "env": {...}} / {"url": ...}. `mcp_tools` connects to each at start-up and fails with a
ValueError that names the server if one does not answer. Each tool becomes a synchronous function with the
tool's name, description, a signature built from its input schema (what the xml protocol shows) and the schema
itself as `json_schema` (what the chat_template protocol gives the template), so the trainer calls it like
any tool of tools/.

A stdio command that starts with `python` or `python3` runs with the trainer's own interpreter
(sys.executable), which has the `mcp` package; a shell's `python` may not. Give a full path for another one.

The sessions live on one event loop in a daemon thread of this module; a call waits for its result at most
`timeout` seconds. A server that crashes fails the call that finds it down, at once; the next call restarts it
(a stdio server) or reconnects (an HTTP one); if that fails, calls fail at once until the next try, RETRY_FIRST
seconds later, then twice as long after each failure, up to RETRY_MAX. Calls that fail while a server is down
are failed tool calls the model sees and is trained on, as any tool's error. A stdio server's stderr goes to a
log file (named in the errors), not to the training log. Everything is closed at interpreter exit, or by
`close_mcp_servers()`.

A server's own tool errors: the SDK's server (MCPServer, FastMCP) sends the message of a `ToolError` to the
client, and only "Error executing tool NAME" for any other exception. `errors_for_the_model(tool)` wraps a
tool so that every exception reaches the model as `Type: message` (tools/kb_mcp_server.py uses it).

Left out on purpose: resources, prompts, sampling and elicitation (the agent only calls tools), and tools a
server adds after start-up (the model's prompt is fixed for the run).
"""

import asyncio
import atexit
import functools
import inspect
import json
import keyword
import logging
import os
import shlex
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Callable, Literal

from tools import event_loop

JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
START_TIMEOUT = 30.0  # seconds a server may take to start by default: a process imports, loads its data
CLOSE_TIMEOUT = 10.0  # seconds to let every server shut down at exit; the SDK kills a stdio server after ~4 s
# After a failed restart calls fail at once until the next try: RETRY_FIRST seconds after the first failure, twice
# as long after each next one, at most RETRY_MAX (an HTTP server back after 5 s is reconnected within 4 s of it).
RETRY_FIRST, RETRY_MAX = 1.0, 60.0
clock = time.monotonic  # the retry schedule's time: a test sets its own
# An HTTP server that restarted since the session began answers 404, which the spec says means "start a new
# session": the SDK reports it as the server's JSON-RPC error, else with its own message.
LOST_SESSION = ("Session not found", "Session terminated")
LOG_TAIL = 800  # characters of a server's stderr log quoted in an error


class MCPToolError(RuntimeError):
    """An MCP tool's error result (`isError`); the message is the server's text."""


class MCPServerDown(ConnectionError):
    """The server crashed or stopped answering; the message says whether it will be restarted."""


# ------------------------------------------------------------------------------------------------
# Server entries: what the recipe writes
# ------------------------------------------------------------------------------------------------
@dataclass
class ServerSpec:
    label: str  # the entry as the recipe wrote it, for messages
    command: list[str] = field(default_factory=list)  # stdio: the program and its arguments
    env: dict[str, str] = field(default_factory=dict)  # stdio: added to the environment the SDK passes on
    url: str = ""  # streamable HTTP


ENTRY_SHAPE = ('a command line ("python my_server.py --flag"), a URL ("http://127.0.0.1:8000/mcp"), '
               '{"command": [...], "env": {...}} or {"url": ...}')


def parse_server(entry) -> ServerSpec:
    """One `mcp_servers` entry -> ServerSpec; a ValueError that shows the accepted shapes otherwise."""
    if isinstance(entry, str) and entry.strip():
        if entry.startswith(("http://", "https://")):
            return ServerSpec(entry, url=entry)
        return ServerSpec(entry, command=_interpreter(shlex.split(entry)))
    if isinstance(entry, dict) and set(entry) in ({"url"}, {"command"}, {"command", "env"}):
        if "url" in entry and isinstance(entry["url"], str) and entry["url"].startswith(("http://", "https://")):
            return ServerSpec(entry["url"], url=entry["url"])
        command = entry.get("command")
        command = shlex.split(command) if isinstance(command, str) else command
        env = entry.get("env") or {}
        if (isinstance(command, list) and command and all(isinstance(c, str) for c in command)
                and isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            return ServerSpec(shlex.join(command), command=_interpreter(command), env=env)
    raise ValueError(f"mcp_servers entry {entry!r} is not a server; write {ENTRY_SHAPE} (env values are strings).")


def _interpreter(command: list[str]) -> list[str]:
    """`command` with a leading `python` or `python3` replaced by this interpreter (module docstring)."""
    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else command


def errors_for_the_model(tool: Callable) -> Callable:
    """`tool` (sync or async) for an MCP server built with the `mcp` package's MCPServer: any exception it raises
    is raised again as the SDK's ToolError, `Type: message`, which the server sends to the client, so the model
    reads what was wrong with its call (the SDK sends only "Error executing tool NAME" for other exceptions)."""
    from mcp.server.mcpserver.exceptions import ToolError

    def reported(e: Exception) -> ToolError:
        return ToolError(str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}")

    if inspect.iscoroutinefunction(tool):
        @functools.wraps(tool)  # the same name, docstring and signature: the same schema
        async def wrapped(*args, **kwargs):
            try:
                return await tool(*args, **kwargs)
            except Exception as e:
                raise reported(e) from None
    else:
        @functools.wraps(tool)
        def wrapped(*args, **kwargs):
            try:
                return tool(*args, **kwargs)
            except Exception as e:
                raise reported(e) from None

    return wrapped


# ------------------------------------------------------------------------------------------------
# The event loop the sessions live on
# ------------------------------------------------------------------------------------------------
_SERVERS: list["_Server"] = []  # every server started, for close_mcp_servers
_SET_UP = threading.Lock()
_set_up = False  # whether close_mcp_servers is registered to run at exit


def _event_loop() -> asyncio.AbstractEventLoop:
    """The loop of every async tool (tools.event_loop), which the sessions live on. The first use here also
    registers the servers' closing at exit (importing this module starts nothing)."""
    global _set_up
    with _SET_UP:
        if not _set_up:
            _set_up = True
            atexit.register(close_mcp_servers)
            logging.getLogger("mcp.client.streamable_http").addFilter(_no_termination_warning)
    return event_loop()


def _no_termination_warning(record: logging.LogRecord) -> bool:
    """Closing the session of an HTTP server that crashed, the SDK warns that it could not end it; the call that
    found the server down has said so already."""
    return not record.getMessage().startswith("Session termination failed")


def _run(coroutine, timeout: float):
    """Run `coroutine` on the loop and wait at most `timeout` seconds; on timeout it is cancelled there."""
    future = asyncio.run_coroutine_threadsafe(coroutine, _event_loop())
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        raise


async def _all(coroutines: list) -> list:
    """Each coroutine's result or exception, run together on the loop."""
    return await asyncio.gather(*coroutines, return_exceptions=True)


def close_mcp_servers() -> None:
    """Close every session and stop every stdio server this module started (registered with atexit)."""
    _close(list(_SERVERS))


def _close(servers: list["_Server"]) -> None:
    for server in servers:
        if server in _SERVERS:
            _SERVERS.remove(server)
    if servers and _set_up:
        try:
            _run(_all([s.close() for s in servers]), CLOSE_TIMEOUT)
        except TimeoutError:
            pass  # a server that will not stop is killed with this process


# ------------------------------------------------------------------------------------------------
# One server: its connection, kept on the loop, restarted once after a crash
# ------------------------------------------------------------------------------------------------
class _Connection:
    """One session with a server, held open by `keep` (an asyncio task on the loop) until `stop` is set. The
    SDK's transports are anyio task groups, which must be entered and left by the same task: that is `keep`."""

    def __init__(self, spec: ServerSpec, log_path: str):
        self.spec, self.log_path = spec, log_path
        self.session = None
        self.ready = asyncio.get_running_loop().create_future()  # the server's tools, or the reason it failed
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: asyncio logs no warning
        self.stop = asyncio.Event()
        self.closed = asyncio.Event()  # set when the session is gone, whatever the reason
        self.keeper = asyncio.ensure_future(self.keep())

    async def keep(self):
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self.transport(stack))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools = await _list_tools(session)
                self.session = session
                self.ready.set_result(tools)
                await self.stop.wait()
        except BaseException as e:  # noqa: BLE001 (an HTTP transport that fails cancels this task: keep the reason)
            if not self.ready.done():
                self.ready.set_exception(ConnectionError(_reason(e)))
        finally:
            self.session = None
            self.closed.set()

    def transport(self, stack: AsyncExitStack):
        if self.spec.url:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(self.spec.url)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        log = stack.enter_context(open(self.log_path, "a", encoding="utf-8"))
        params = StdioServerParameters(command=self.spec.command[0], args=self.spec.command[1:], env=self.spec.env)
        return stdio_client(params, errlog=log)

    async def close(self):
        if self.ready.done():
            self.stop.set()
        else:  # still starting (a server that never answers): stop waiting for it
            self.keeper.cancel()
        try:
            await asyncio.wait_for(self.closed.wait(), CLOSE_TIMEOUT)
        except asyncio.TimeoutError:
            pass  # the SDK bounds its own shutdown; this only guards against a bug there


class _Server:
    """A server's current connection and whether it is down. Runs on the loop only, so it needs no lock."""

    def __init__(self, spec: ServerSpec, timeout: float, start_timeout: float):
        self.spec, self.timeout, self.start_timeout = spec, timeout, start_timeout
        self.log_path = ""  # a stdio server's stderr
        if spec.command:
            handle, self.log_path = tempfile.mkstemp(prefix=f"mcp-{os.path.basename(spec.command[0])}-", suffix=".log")
            os.close(handle)  # each connection opens it to append
        self.connection: _Connection | None = None
        self.down = ""  # why the server went down; "" while it is up
        self.restart_error = ""  # why the last restart failed; "" if none did since it went down
        self.retry_at = 0.0  # clock() before which no restart is tried (after a failed one)
        self.failed_restarts = 0  # since the server went down: sets the next wait (RETRY_FIRST, doubled each time)
        self.restarting: asyncio.Future | None = None  # the restart in progress, which concurrent calls share
        self.closing = False  # close_mcp_servers ran: nothing starts it again

    async def start(self) -> list:
        """Connect; the server's tools. ConnectionError with the reason if it does not answer in start_timeout."""
        self.connection = connection = _Connection(self.spec, self.log_path)
        try:
            return await asyncio.wait_for(asyncio.shield(connection.ready), self.start_timeout)
        except BaseException as e:
            await asyncio.shield(connection.close())
            if isinstance(e, asyncio.TimeoutError):
                raise ConnectionError(f"it did not answer `initialize` within {self.start_timeout:g}s") from None
            raise

    async def call(self, name: str, arguments: dict) -> str:
        connection = await self.up()
        if connection.session is None:  # the session ended since the last call
            raise self.went_down(connection, "the connection closed")
        call = asyncio.ensure_future(connection.session.call_tool(name, arguments))
        closed = asyncio.ensure_future(connection.closed.wait())
        try:
            await asyncio.wait({call, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():  # the session ended under the call
            raise self.went_down(connection, "the connection closed during the call")
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            result = call.result()
        except MCPError as e:
            if e.code == CONNECTION_CLOSED or e.message in LOST_SESSION:
                raise self.went_down(connection, e.message) from None
            raise MCPToolError(e.message) from None  # a JSON-RPC error the server sent, e.g. unknown arguments
        except (OSError, EOFError) as e:
            raise self.went_down(connection, _reason(e)) from None
        if result.is_error:
            text = result_text(result)
            # the SDK's servers put their own words before the tool's message: the model needs the message
            text = text.removeprefix(f"Error executing tool {name}: ")
            raise MCPToolError(text or f"the server gave an error result with no text for {name}")
        return result_text(result)

    async def up(self) -> _Connection:
        """The live connection, restarting a server that went down; MCPServerDown if it stays down."""
        if not self.down:
            return self.connection
        if self.closing or clock() < self.retry_at:
            raise MCPServerDown(self.down_message())
        if self.restarting is None:  # the first call to find it down restarts it; the others wait for that
            self.restarting = asyncio.ensure_future(self.restart())
        await asyncio.shield(self.restarting)
        if self.down:
            raise MCPServerDown(self.down_message())
        return self.connection

    async def restart(self):
        try:
            await self.start()
            self.down = self.restart_error = ""
            self.failed_restarts = 0
        except ConnectionError as e:  # start's, which says why
            self.restart_error = str(e)
            self.retry_at = clock() + self.retry_wait()
            self.failed_restarts += 1
        finally:
            self.restarting = None

    def retry_wait(self) -> float:
        """Seconds from the last failed restart to the next try."""
        return min(RETRY_FIRST * 2 ** self.failed_restarts, RETRY_MAX)

    def went_down(self, connection: _Connection, reason: str) -> MCPServerDown:
        if connection is not self.connection:  # a late error from the connection before a restart
            return MCPServerDown(f"MCP server {self.spec.label!r} was restarted during the call ({reason}); call it "
                                 "again.")
        if not self.down:
            self.down = f"it stopped answering ({reason})"
            connection.stop.set()  # lets the SDK reap a dead process
        return MCPServerDown(self.down_message())

    def down_message(self) -> str:
        restart = "restart" if self.spec.command else "reconnect"
        if self.closing:
            then = ""
        elif self.restart_error:
            then = (f"; the {restart} failed: {self.restart_error}; calls fail at once until the next try, "
                    f"{min(RETRY_FIRST * 2 ** (self.failed_restarts - 1), RETRY_MAX):g}s after it")
        else:
            then = f"; the next call will {restart} it"
        return f"MCP server {self.spec.label!r} is down: {self.down}{then}.{self.log_hint()}"

    def log_hint(self) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                tail = f.read()[-LOG_TAIL:].strip()
        except OSError:
            tail = ""
        return f" Its stderr is in {self.log_path}" + (f"; it ends:\n{tail}" if tail else ".")

    async def close(self):
        self.closing = True
        self.down = self.down or "it was closed (close_mcp_servers)"
        if self.connection is not None:
            await self.connection.close()
        if self.log_path and os.path.isfile(self.log_path) and not os.path.getsize(self.log_path):
            os.remove(self.log_path)  # nothing to read: no file left behind


async def _list_tools(session) -> list:
    from mcp_types import PaginatedRequestParams

    tools, cursor = [], None
    while True:
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += page.tools
        if not (cursor := page.next_cursor):
            return tools


def _reason(e: BaseException) -> str:
    """The innermost cause of a failure, as `Type: message`: the SDK's transports raise exception groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def result_text(result) -> str:
    """The text of a tool result: its text items joined by newlines, other items described in a few words, or
    the structured content as JSON when there are no items."""
    parts = []
    for item in result.content:
        if item.type == "text":
            parts.append(item.text)
        elif item.type in ("image", "audio"):
            parts.append(f"[{item.type} ({item.mime_type}), not shown]")
        elif item.type == "resource":
            text = getattr(item.resource, "text", None)
            parts.append(text if text is not None else f"[resource {item.resource.uri}, not shown]")
        elif item.type == "resource_link":
            parts.append(f"[resource link: {item.uri}]")
        else:
            parts.append(f"[{item.type} content, not shown]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------
# Tools as functions
# ------------------------------------------------------------------------------------------------
def mcp_tools(servers: list, timeout: float, start_timeout: float | None = None) -> list[Callable[..., str]]:
    """One function per tool of every server in `servers` (`mcp_servers` entries, module docstring), in order.
    A call waits `timeout` seconds for its result (the trainer's `tool_timeout`). Connects to every server now,
    each within `start_timeout` seconds (default: the larger of `timeout` and START_TIMEOUT), and fails with a
    ValueError naming the server and the fix if one does not start or answer, or if two give tools one name."""
    specs = [parse_server(entry) for entry in servers]
    labels = [spec.label for spec in specs]
    if twice := next((label for label in labels if labels.count(label) > 1), None):
        raise ValueError(f"mcp_servers lists {twice!r} twice; list each server once.")
    start_timeout = max(timeout, START_TIMEOUT) if start_timeout is None else start_timeout
    started = [_Server(spec, timeout, start_timeout) for spec in specs]
    _SERVERS.extend(started)
    # all at once: start-up costs the slowest server, not the sum
    outcomes = _run(_all([s.start() for s in started]), start_timeout + CLOSE_TIMEOUT + 5.0)
    failed = [(s, e) for s, e in zip(started, outcomes) if isinstance(e, BaseException)]
    if failed:
        server, error = failed[0]
        _close(started)
        raise ValueError(f"MCP server {server.spec.label!r} (mcp_servers) did not start: {error}. "
                         f"{_start_fix(server)}") from None
    functions, owner = [], {}
    for server, tools in zip(started, outcomes):
        for tool in tools:
            if tool.name in owner:
                _close(started)
                raise ValueError(f"MCP servers {owner[tool.name]!r} and {server.spec.label!r} both have a tool "
                                 f"named {tool.name!r}, and the model calls a tool by its name. Remove one of the "
                                 "servers from mcp_servers, or rename the tool in one of them.")
            owner[tool.name] = server.spec.label
            functions.append(tool_function(server, tool))
    return functions


def _start_fix(server: _Server) -> str:
    if server.spec.url:
        return ("Start the server first, and check that it serves streamable HTTP at this URL (FastMCP and "
                "MCPServer serve it under /mcp), or remove the entry.")
    return (f"Run `{server.spec.label}` in a shell: it should start and wait for input, not exit; check that "
            f"`{server.spec.command[0]}` is installed and on PATH (or give its full path).{server.log_hint()}")


def tool_function(server: _Server, tool) -> Callable[..., str]:
    """The function the model calls for one MCP tool: name, docstring, signature and `json_schema` from the
    tool; calling it runs the tool on its server and returns the text of the result."""
    signature = tool_signature(tool.input_schema)
    keywords_only = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())

    def call(*args, **kwargs) -> str:
        # a call that does not fit fails here with a TypeError, as a Python tool's would, without a round trip
        arguments = kwargs if keywords_only and not args else signature.bind(*args, **kwargs).arguments
        # a call that finds the server down may first wait for its restart
        timeout = server.timeout + (server.start_timeout if server.down else 0.0)
        try:
            return _run(server.call(tool.name, dict(arguments)), timeout)
        except TimeoutError:
            raise TimeoutError(f"MCP tool {tool.name!r} of server {server.spec.label!r} gave no result within "
                               f"{timeout:g}s.") from None

    call.__name__ = call.__qualname__ = tool.name
    description = inspect.cleandoc(tool.description or "")  # servers often send a docstring as written
    call.__doc__ = description
    call.__signature__ = signature
    # for typing.get_type_hints, as a Python tool's hints
    call.__annotations__ = {**{p.name: p.annotation for p in signature.parameters.values()
                               if p.annotation is not p.empty}, "return": str}
    call.json_schema = {"type": "function", "function": {"name": tool.name, "description": description,
                                                         "parameters": tool.input_schema}}
    call.mcp_server = server.spec.label
    return call


def tool_signature(schema: dict) -> inspect.Signature:
    """A Python signature for a tool's input schema: the required properties first, without a default, then the
    others with the schema's default (else None), annotated from their JSON types. A property whose name is not
    a Python identifier makes it `(**arguments)`."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    if not all(name.isidentifier() and not keyword.iskeyword(name) for name in properties):
        return inspect.Signature([inspect.Parameter("arguments", inspect.Parameter.VAR_KEYWORD)], return_annotation=str)
    # POSITIONAL_OR_KEYWORD, required first: the xml prompt then reads as a Python tool's, `search(query: str, ...)`
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=json_annotation(prop),
                                **({} if name in required else {"default": prop.get("default")}))
              for name, prop in sorted(properties.items(), key=lambda item: item[0] not in required)]
    return inspect.Signature(params, return_annotation=str)


def json_annotation(prop: dict):
    """The Python type of a JSON schema property: its enum as a Literal, its `type` (a nullable one as `X | None`,
    an array of typed items as `list[X]`), or the first typed branch of an anyOf / oneOf; no annotation else."""
    if not isinstance(prop, dict):
        return inspect.Parameter.empty
    if prop.get("enum"):
        return Literal[tuple(prop["enum"])]
    kind = prop.get("type")
    # ["integer", "null"], or anyOf [{"type": "integer"}, {"type": "null"}] as pydantic writes `int | None`
    branches = [{**prop, "type": k} for k in kind] if isinstance(kind, list) else prop.get("anyOf") or prop.get("oneOf")
    if branches:
        branches = [b for b in branches if isinstance(b, dict)]
        typed = [json_annotation(b) for b in branches if b.get("type") != "null"]
        inner = typed[0] if typed else inspect.Parameter.empty
        nullable = len(typed) < len(branches) and inner is not inspect.Parameter.empty
        return inner | None if nullable else inner
    if kind == "array" and (item := json_annotation(prop.get("items"))) is not inspect.Parameter.empty:
        return list[item]
    return JSON_TYPES.get(kind, inspect.Parameter.empty)
