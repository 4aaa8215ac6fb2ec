"""MCP servers as agent tools: every tool of every server the recipe names, as a plain function.

    from mt_grpo.tools.mcp import mcp_tools, mcp_tools_from_map
    tools = mcp_tools(["python mt_grpo/tools/kb_mcp_server.py --seed 0", "http://127.0.0.1:8765/mcp"], timeout=10.0)
    # (a leading `python` runs with this interpreter; start the HTTP one first:
    #  .venv/bin/python mt_grpo/tools/kb_mcp_server.py --transport http --port 8765)
    tools[0](query="capital of Ratomora")  # the server's text; an error result raises with the server's text

    # the `mcpServers` map that Claude Desktop, Cursor, Claude Code, fastmcp and verl's mcp_server.json write
    tools = mcp_tools_from_map({"mcpServers": {
        "kb": {"command": "python", "args": ["mt_grpo/tools/kb_mcp_server.py", "--seed", "0"], "env": {"KEY": "1"}},
        "web": {"url": "https://example.org/sse", "auth_token": "${WEB_TOKEN}"},
    }}, selected=["search"], timeout=10.0)

Two ways to name servers, usable together:
  `mcp_servers` (a list): a stdio command line (split like a shell would), or the URL of a server, or a dict
      {"command": [...], "env": {...}} / {"url": ...}.
  `mcp_servers_config` (the map, a .json file or inline): {"mcpServers": {name: entry}} (the top-level key may
      be left out). An entry (SERVER_KEYS):
        stdio   command (str, or a list), args (list), env ({str: str}), cwd
        remote  url (or Gemini CLI's httpUrl), headers ({str: str}), auth_token (verl) or auth (fastmcp): a
                token sent as `Authorization: Bearer <token>`
        either  transport or type: stdio | http (also streamable-http, streamable_http, streamableHttp) | sse;
                includeTools / excludeTools (Gemini CLI's per-server filter); disabled: true skips the entry;
                description, icon, timeout, trust, autoApprove, alwaysAllow: read by editors, not here
      `${VAR}` (or `${VAR:-default}`) in any string is the environment variable, as Claude Code expands it, so
      that a token stays out of the recipe.
  A remote server's transport, when the entry does not name it: SSE for a URL whose path is `/sse` or has an
  `/sse/` part (fastmcp's and the MCP clients' convention) or for an entry with `auth_token` (verl connects those
  with its SSETransport), else streamable HTTP. `mcp_tool_filter` (verl's tool_selected_list) keeps only the
  tools it names, from all servers: an unselected tool never reaches the model's prompt, and a name no server
  has fails with the names they have.

`mcp_tools` connects to each at start-up and fails with a ValueError that names the server if one does not
answer (a server that refuses the connection for want of a token says so). Each tool becomes a synchronous
function with the tool's name, description, a signature built from its input schema (what the xml protocol
shows) and the schema itself as `json_schema` (what the chat_template protocol gives the template), so the
trainer calls it like any tool of tools/.

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

Left out on purpose: resources, prompts, sampling and elicitation (the agent only calls tools), tools a
server adds after start-up (the model's prompt is fixed for the run), OAuth (it needs a person at a browser: give
the token), websocket transports, and VS Code's `servers` / `inputs` shape of the map.
"""

import asyncio
import atexit
import functools
import inspect
import json
import keyword
import logging
import os
import re
import shlex
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Callable, Literal
from urllib.parse import urlparse

from mt_grpo.base.runtime import event_loop

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
logger = logging.getLogger("mt_grpo")
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
    label: str  # the entry as the recipe wrote it (a list entry) or its name (a map entry), for messages
    command: list[str] = field(default_factory=list)  # stdio: the program and its arguments
    env: dict[str, str] = field(default_factory=dict)  # stdio: added to the environment the SDK passes on
    cwd: str | None = None  # stdio: the folder it runs in (None: the trainer's)
    url: str = ""  # a remote server
    transport: str = "stdio"  # stdio | http (streamable HTTP) | sse
    headers: dict[str, str] = field(default_factory=dict)  # sent with every HTTP request (a token)
    include: list[str] | None = None  # the server's own tool filter: only these (None: all)
    exclude: list[str] = field(default_factory=list)  # ... and never these
    source: str = "mcp_servers"  # the recipe field that named it, for messages
    sse_by_token: bool = False  # SSE because the entry has verl's auth_token and names no transport


ENTRY_SHAPE = ('a command line ("python my_server.py --flag"), a URL ("http://127.0.0.1:8000/mcp"), '
               '{"command": [...], "env": {...}} or {"url": ...}')
# A map entry's transport names, as Claude Code, VS Code, Cline and fastmcp write them -> ours
TRANSPORTS = {"stdio": "stdio", "sse": "sse", "http": "http", "streamable-http": "http", "streamable_http": "http",
              "streamableHttp": "http"}
# Keys an entry may hold: those read here, and those editors read (shown to a person, or auto-approval), which
# change nothing in training. Any other key fails, naming these.
SERVER_KEYS = {"command", "args", "env", "cwd", "url", "httpUrl", "headers", "auth_token", "auth", "transport",
               "type", "includeTools", "excludeTools", "disabled"}
EDITOR_KEYS = {"description", "icon", "timeout", "trust", "autoApprove", "alwaysAllow", "name"}
_TIMEOUT_NOTED: set[str] = set()  # servers whose `timeout` was logged as unused


def parse_server(entry) -> ServerSpec:
    """One `mcp_servers` entry -> ServerSpec; a ValueError that shows the accepted shapes otherwise."""
    if isinstance(entry, str) and entry.strip():
        if entry.startswith(("http://", "https://")):
            return ServerSpec(entry, url=entry, transport=url_transport(entry))
        return ServerSpec(entry, command=_interpreter(shlex.split(entry)))
    if isinstance(entry, dict) and set(entry) in ({"url"}, {"command"}, {"command", "env"}):
        if "url" in entry and isinstance(entry["url"], str) and entry["url"].startswith(("http://", "https://")):
            return ServerSpec(entry["url"], url=entry["url"], transport=url_transport(entry["url"]))
        command = entry.get("command")
        command = shlex.split(command) if isinstance(command, str) else command
        env = entry.get("env") or {}
        if (isinstance(command, list) and command and all(isinstance(c, str) for c in command)
                and isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            return ServerSpec(shlex.join(command), command=_interpreter(command), env=env)
    raise ValueError(f"mcp_servers entry {entry!r} is not a server; write {ENTRY_SHAPE} (env values are strings).")


def url_transport(url: str) -> str:
    """sse for a URL whose path is `/sse` or has an `/sse/` part (fastmcp's rule, which MCP clients share), else
    http (streamable HTTP, the transport the MCP spec recommends)."""
    return "sse" if re.search(r"/sse(/|$)", urlparse(url).path) else "http"


def servers_map(servers, source: str = "mcp_servers_config") -> dict:
    """The name -> entry map of `servers`: a dict with or without its top-level "mcpServers" key, or the path of
    a .json file holding one. `source` names where it came from, in errors."""
    if isinstance(servers, str):
        if not os.path.isfile(servers):
            raise ValueError(f"{source}: no file {servers!r}. Give the path of a JSON file "
                             '{"mcpServers": {name: {...}}} (Claude Desktop\'s, verl\'s mcp_server.json), or the map '
                             "itself in the recipe.")
        with open(servers, encoding="utf-8") as f:
            try:
                servers = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: {f.name} is not JSON ({e}); fix the file.") from None
    if isinstance(servers, dict) and "mcpServers" in servers:
        servers = servers["mcpServers"]
    if not isinstance(servers, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in servers.items()):
        raise ValueError(f"{source} is {_short(servers)}, not a map of servers; write "
                         '{"mcpServers": {"name": {"command": "...", "args": [...]}, "other": {"url": "..."}}}.')
    return servers


def parse_map_entry(name: str, entry: dict, source: str = "mcp_servers_config") -> ServerSpec | None:
    """One server of an `mcpServers` map -> ServerSpec (None for a `disabled` one); a ValueError naming the server,
    the key and the fix otherwise. `source`: the field (or file) that holds the map, for messages."""
    where = f"MCP server {name!r} ({source})"
    unknown = sorted(set(entry) - SERVER_KEYS - EDITOR_KEYS)
    if unknown:
        raise ValueError(f"{where} has key(s) {unknown}, which this trainer does not read; remove them. An entry "
                         f"holds {sorted(SERVER_KEYS)} (and, read by editors only, {sorted(EDITOR_KEYS)}).")
    if entry.get("disabled") is True:
        return None
    entry = _expand(entry, where)
    kind = entry.get("transport", entry.get("type"))
    if kind is not None and kind not in TRANSPORTS:
        raise ValueError(f"{where} has transport {kind!r}; write one of {sorted(TRANSPORTS)}.")
    kind = TRANSPORTS.get(kind)
    url = entry.get("url") or entry.get("httpUrl")
    if ("command" in entry) == bool(url):
        raise ValueError(f"{where} needs either a `command` (a stdio server) or a `url` (a remote one); it has "
                         f"{'both' if url else 'neither'}.")
    include, exclude = (_names(entry.get(key), f"{where}: {key}") for key in ("includeTools", "excludeTools"))
    if "timeout" in entry and name not in _TIMEOUT_NOTED:
        _TIMEOUT_NOTED.add(name)
        logger.info("%s: its `timeout` (%s ms) is not used here: `tool_timeout` bounds every tool call, and "
                    "`mcp_startup_timeout` its start.", where, entry["timeout"])
    if url:
        return _remote(name, entry, url, kind, where, include, exclude or [], source)
    if kind not in (None, "stdio"):
        raise ValueError(f"{where} has a `command` and transport {kind!r}; a command is a stdio server: remove the "
                         "transport, or give the server's `url`.")
    command, args = entry["command"], entry.get("args", [])
    command = [command] if isinstance(command, str) else command  # a program, as the editors run it: not split
    env, cwd = entry.get("env") or {}, entry.get("cwd")
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)
            and isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ValueError(f"{where}: `command` is a program (a string) and `args` a list of strings; got command "
                         f"{entry['command']!r}, args {args!r}.")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())) or \
            not isinstance(cwd, (str, type(None))):
        raise ValueError(f"{where}: `env` is a map of strings (quote numbers: \"1\") and `cwd` a folder; got env "
                         f"{env!r}, cwd {cwd!r}.")
    return ServerSpec(name, command=_interpreter(command + args), env=env, cwd=cwd, include=include,
                      exclude=exclude or [], source=source)


def _remote(name: str, entry: dict, url, kind: str | None, where: str, include, exclude, source: str) -> ServerSpec:
    if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise ValueError(f"{where}: url {url!r} is not an http(s) URL; give the server's address, e.g. "
                         "\"http://127.0.0.1:8000/mcp\" (streamable HTTP) or \".../sse\" (SSE).")
    headers = entry.get("headers") or {}
    if not (isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())):
        raise ValueError(f"{where}: `headers` is a map of strings; got {headers!r}.")
    token = entry.get("auth_token", entry.get("auth"))
    if token is not None:
        if "auth_token" in entry and "auth" in entry:
            raise ValueError(f"{where} has both `auth_token` and `auth`; keep one.")
        if token == "oauth" or not isinstance(token, str):
            raise ValueError(f"{where}: auth {token!r} is not supported (OAuth needs a person at a browser); give "
                             "the token itself as `auth_token`, or an `Authorization` header in `headers`.")
        if any(k.lower() == "authorization" for k in headers):
            raise ValueError(f"{where} has both a token (auth_token / auth) and an Authorization header; keep one.")
        headers = {**headers, "Authorization": f"Bearer {token}"}
    by_token = kind is None and "auth_token" in entry  # verl sends such an entry over SSE; the others go by the URL
    if kind is None:
        kind = "sse" if by_token else "http" if "httpUrl" in entry else url_transport(url)
    if kind == "stdio":
        raise ValueError(f"{where} has a `url` and transport 'stdio'; a URL is a remote server: write transport "
                         "http or sse, or give a `command`.")
    return ServerSpec(name, url=url, transport=kind, headers=headers, include=include, exclude=exclude,
                      source=source, sse_by_token=by_token)


def _expand(value, where: str):
    """`value` with `${VAR}` / `${VAR:-default}` in its strings replaced by the environment's values."""
    if isinstance(value, dict):
        return {k: _expand(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, where) for v in value]
    if not isinstance(value, str):
        return value

    def variable(match: re.Match) -> str:
        name, default = match.group(1), match.group(3)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ValueError(f"{where} uses ${{{name}}}, and the environment has no {name}: export it (or write "
                             f"${{{name}:-default}}).")
        return default

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", variable, value)


def _names(value, where: str) -> list[str] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{where} is a list of tool names; got {value!r}.")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


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
    """The loop of every async tool (mt_grpo.base.runtime.event_loop), which the sessions live on. The first use
    here also registers the servers' closing at exit (importing this module starts nothing)."""
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
        self.refused = ""  # a remote server's refusal of a request ("HTTP 401 Unauthorized"), for the start error
        self.ready = asyncio.get_running_loop().create_future()  # the server's tools, or the reason it failed
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: asyncio logs no warning
        self.stop = asyncio.Event()
        self.closed = asyncio.Event()  # set when the session is gone, whatever the reason
        self.keeper = asyncio.ensure_future(self.keep())

    async def keep(self):
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                read, write = await self.open(stack)
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools = await _list_tools(session)
                self.session = session
                self.ready.set_result(tools)
                await self.stop.wait()
        except BaseException as e:  # noqa: BLE001 (an HTTP transport that fails cancels this task: keep the reason)
            if not self.ready.done():
                reason = _reason(e)
                refused = f" ({self.refused})" if self.refused and self.refused.split()[1] not in reason else ""
                self.ready.set_exception(ConnectionError(reason + refused))
        finally:
            self.session = None
            self.closed.set()

    async def open(self, stack: AsyncExitStack):
        """The (read, write) streams of the spec's transport, entered on `stack`, as the SDK's ClientSessionGroup
        opens them."""
        spec = self.spec
        if spec.transport == "sse":
            from mcp.client.sse import sse_client

            return await stack.enter_async_context(sse_client(spec.url, headers=spec.headers or None,
                                                              httpx_client_factory=self.http_client))
        if spec.transport == "http":
            from mcp.client.streamable_http import streamable_http_client

            client = await stack.enter_async_context(self.http_client(headers=spec.headers or None))
            return await stack.enter_async_context(streamable_http_client(spec.url, http_client=client))
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        log = stack.enter_context(open(self.log_path, "a", encoding="utf-8"))
        params = StdioServerParameters(command=spec.command[0], args=spec.command[1:], env=spec.env, cwd=spec.cwd)
        return await stack.enter_async_context(stdio_client(params, errlog=log))

    def http_client(self, **kwargs):
        """The SDK's HTTP client, noting the status of a refused request: the streamable-HTTP transport reports
        a 401 only as "Server returned an error response", and the fix depends on it."""
        from mcp.shared._httpx_utils import create_mcp_http_client

        async def note(response):
            if response.status_code >= 400:
                self.refused = f"HTTP {response.status_code} {response.reason_phrase}"

        client = create_mcp_http_client(**kwargs)
        client.event_hooks = {**client.event_hooks, "response": [*client.event_hooks["response"], note]}
        return client

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
    text = str(e).split("\n")[0]  # httpx adds a line of advice: the fix is ours to give
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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
def mcp_tools(servers: list, timeout: float, start_timeout: float | None = None, *, config=None,
              selected: list[str] | None = None) -> list[Callable[..., str]]:
    """One function per tool of every server in `servers` (`mcp_servers` entries, module docstring) and in
    `config` (an `mcpServers` map, or the path of its JSON file: `mcp_servers_config`), in order; with `selected`
    (`mcp_tool_filter`), only the tools it names. A call waits `timeout` seconds for its result (the trainer's
    `tool_timeout`). Connects to every server now, each within `start_timeout` seconds (default: the larger of
    `timeout` and START_TIMEOUT), and fails with a ValueError naming the server and the fix if one does not start
    or answer, if two give tools one name, or if a filter names a tool no server has."""
    return _from(servers, config, selected, timeout, start_timeout, "mcp_servers_config", "mcp_tool_filter")


def mcp_tools_from_map(servers: dict, selected: list[str] | None, timeout: float, *,
                       start_timeout: float | None = None, source: str = "mcp_servers_config",
                       filter_field: str = "mcp_tool_filter") -> list[Callable[..., str]]:
    """The tools of an `mcpServers` map (the parsed JSON of Claude Desktop's config or verl's mcp_server.json, with
    or without the top-level "mcpServers" key), only those `selected` names (verl's tool_selected_list; None or []:
    all). `source` and `filter_field` name the map and the filter in errors (an adapter names its own fields). As
    `mcp_tools` otherwise."""
    return _from([], servers, selected, timeout, start_timeout, source, filter_field)


def _from(servers: list, config, selected, timeout: float, start_timeout: float | None, source: str,
          filter_field: str) -> list[Callable[..., str]]:
    specs = [parse_server(entry) for entry in servers]
    if config is not None:
        specs += [spec for name, entry in servers_map(config, source).items()
                  if (spec := parse_map_entry(name, entry, source))]
    return connect(specs, selected, timeout, start_timeout, filter_field)


def connect(specs: list[ServerSpec], selected: list[str] | None, timeout: float, start_timeout: float | None,
            filter_field: str = "mcp_tool_filter") -> list[Callable[..., str]]:
    """Start every server of `specs` at once, and the functions of the tools the filters keep (each server's
    include/exclude, then `selected`); a ValueError with the fix, every server closed, when any step fails."""
    labels = [spec.label for spec in specs]
    if twice := next((label for label in labels if labels.count(label) > 1), None):
        raise ValueError(f"{specs[labels.index(twice)].source} lists {twice!r} twice; list each server once.")
    selected = _names(selected, filter_field) or None  # [] keeps all, as verl's empty tool_selected_list
    if selected is not None and not specs:
        raise ValueError(f"{filter_field} {selected} selects MCP tools, and no server is given: name the servers "
                         "in mcp_servers or mcp_servers_config, or remove the filter.")
    start_timeout = max(timeout, START_TIMEOUT) if start_timeout is None else start_timeout
    started = [_Server(spec, timeout, start_timeout) for spec in specs]
    _SERVERS.extend(started)
    # all at once: start-up costs the slowest server, not the sum
    outcomes = _run(_all([s.start() for s in started]), start_timeout + CLOSE_TIMEOUT + 5.0)
    failed = [(s, e) for s, e in zip(started, outcomes) if isinstance(e, BaseException)]
    if failed:
        server, error = failed[0]
        _close(started)
        raise ValueError(f"MCP server {server.spec.label!r} ({server.spec.source}) did not start: {error}. "
                         f"{_start_fix(server, error)}") from None
    try:
        kept = _filter([(server, tools) for server, tools in zip(started, outcomes)], selected, filter_field)
    except ValueError:
        _close(started)
        raise
    _close([server for server, tools in kept if not tools])  # nothing of theirs is called: no process left idle
    functions, owner = [], {}
    for server, tools in kept:
        for tool in tools:
            if tool.name in owner:
                _close(started)
                raise ValueError(f"MCP servers {owner[tool.name]!r} and {server.spec.label!r} both have a tool "
                                 f"named {tool.name!r}, and the model calls a tool by its name. Keep one of them "
                                 f"with {filter_field} (or a server's includeTools / excludeTools), remove one of "
                                 f"the servers from {server.spec.source}, or rename the tool in one of them.")
            owner[tool.name] = server.spec.label
            functions.append(tool_function(server, tool))
    return functions


def _filter(served: list[tuple["_Server", list]], selected: list[str] | None,
            filter_field: str) -> list[tuple["_Server", list]]:
    """Each server's tools that its includeTools / excludeTools and then `selected` keep; a name that matches no
    tool fails, naming the tools there are (a typo would otherwise drop a tool without a word)."""
    kept = []
    for server, tools in served:
        names = [tool.name for tool in tools]
        spec = server.spec
        for key, wanted in (("includeTools", spec.include or []), ("excludeTools", spec.exclude)):
            if missing := [n for n in wanted if n not in names]:
                raise ValueError(f"MCP server {spec.label!r} ({spec.source}): {key} names {missing}, which it does "
                                 f"not have; its tools are {names}.")
        kept.append((server, [t for t in tools if (spec.include is None or t.name in spec.include)
                              and t.name not in spec.exclude]))
    if selected is None:
        return kept
    available = [tool.name for _, tools in kept for tool in tools]
    if missing := [name for name in selected if name not in available]:
        raise ValueError(f"{filter_field} names {missing}, which no MCP server has; the servers' tools are "
                         f"{available}. Fix the names, or add the server that has them.")
    return [(server, [t for t in tools if t.name in selected]) for server, tools in kept]


def _start_fix(server: _Server, error: BaseException) -> str:
    spec = server.spec
    # a list entry (mcp_servers) is a bare URL: a token or a transport is written in a map entry
    where = "an entry of mcp_servers_config" if spec.source == "mcp_servers" else f"its entry of {spec.source}"
    if spec.url and re.search(r"\b(401|403)\b|Unauthorized|Forbidden", str(error)):
        given = "its token was refused" if any(k.lower() == "authorization" for k in spec.headers) else \
            "no token was sent"
        return (f"The server refused the connection ({given}): give its token as `auth_token` (or an "
                f"`Authorization: Bearer ...` header in `headers`) in {where}, e.g. \"auth_token\": "
                "\"${MY_TOKEN}\" with MY_TOKEN exported.")
    if spec.transport == "sse":
        return ("Start the server first, and check that it serves SSE at this URL (FastMCP and MCPServer serve it "
                f"under /sse); for a streamable-HTTP server, set \"transport\": \"http\" in {where}"
                + (" (an entry with auth_token connects over SSE, as verl does)" if spec.sse_by_token else "")
                + ", or remove the entry.")
    if spec.url:
        return ("Start the server first, and check that it serves streamable HTTP at this URL (FastMCP and "
                "MCPServer serve it under /mcp; an SSE server's URL ends in /sse, or set \"transport\": \"sse\" in "
                f"{where}), or remove the entry.")
    shown = spec.label if spec.source == "mcp_servers" else shlex.join(spec.command)
    return (f"Run `{shown}` in a shell: it should start and wait for input, not exit; check "
            f"that `{spec.command[0]}` is installed and on PATH (or give its full path).{server.log_hint()}")


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
