"""MCP servers as agent tools (tools/mcp.py) against real server processes: the knowledge base's server
(tools/kb_mcp_server.py, with its test tools `crash` and `sleep`) over stdio and over streamable HTTP, one
process of each for the module. Listing and calling tools, the schemas both tool formats show the model,
error results, timeouts, a crash and the restart after it, servers that do not start, and episodes of the
trainer's rollout loop that call the server. The `mcpServers` map (mcp_servers_config): a stdio, a streamable-HTTP
and an SSE server, the two remote ones refusing requests without a bearer token (one process each for the module),
and the tool filters."""

import asyncio
import contextlib
import inspect
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from helpers import ROOT, make_env, xml_answer, xml_call
from mt_grpo.base.protocol import ToolCall, XMLProtocol, describe_tools, get_protocol, neutral_arguments, tool_schemas
from scripted_policy import ScriptedPolicy
from mt_grpo.rollout.tool_calls import run_tool_calls
from mt_grpo.tools.mcp import (MCPServerDown, MCPToolError, mcp_tools, mcp_tools_from_map, parse_map_entry,
                               parse_server, tool_signature)

SERVER = os.path.join(ROOT, "mt_grpo", "tools", "kb_mcp_server.py")
STDIO = shlex.join([sys.executable, SERVER, "--seed", "0", "--crashable"])
TIMEOUT = 2.0  # seconds a call may take: a search takes milliseconds
QUESTION = "What is the capital of Ratomora?"
RATOMORA = "Ratomora: Ratomora is a country. Its capital is Lotrowick."  # how the first document starts (seed 0)

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stdio_tools():
    """The stdio server's tools by name: search, crash, sleep."""
    return {fn.__name__: fn for fn in mcp_tools([STDIO], timeout=TIMEOUT)}


@contextlib.contextmanager
def http_server(port: int | None = None, command: list[str] | None = None, transport: str = "http",
                token: str | None = None):
    """The URL of a new knowledge base server over streamable HTTP, or SSE (on `port`, else a free one; started by
    `command`, else with the test tools, refusing requests without `token` if given), once it accepts
    connections."""
    port = port or free_port()
    command = command or [sys.executable, SERVER, "--transport", transport, "--port", str(port), "--crashable",
                          *(["--token", token] if token else [])]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the HTTP server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/{'sse' if transport == 'sse' else 'mcp'}"
    finally:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def http_url():
    with http_server() as url:
        yield url


@pytest.fixture(scope="module")
def http_tools(http_url):
    return {fn.__name__: fn for fn in mcp_tools([http_url], timeout=TIMEOUT)}


@pytest.fixture(scope="module")
def local_search(kb):
    """The in-process `search` over the same knowledge base, which the server's must match."""
    from mt_grpo.tools.search import make_search_tool

    return make_search_tool(kb[0])


# ------------------------------------------------------------------------------------------------
# listing and calling, over both transports
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_tools_are_listed_with_their_schema_and_search_finds_the_document(request, transport, local_search):
    tools = request.getfixturevalue(f"{transport}_tools")
    assert list(tools) == ["search", "crash", "sleep"]
    search = tools["search"]
    assert search.json_schema == {"type": "function", "function": {
        "name": "search",
        "description": inspect.getdoc(local_search),
        "parameters": {"type": "object", "title": "searchArguments", "required": ["query"],
                       "properties": {"query": {"title": "Query", "type": "string"},
                                      "num_results": {"title": "Num Results", "type": "integer", "default": 3}}}}}
    assert inspect.signature(search) == inspect.signature(local_search)  # (query: str, num_results: int = 3) -> str
    assert search.__doc__ == inspect.getdoc(local_search)
    assert search(query="capital of Ratomora", num_results=1).startswith(RATOMORA)
    assert search(query="capital of Ratomora") == local_search(query="capital of Ratomora")
    assert search("capital of Ratomora", 1) == local_search("capital of Ratomora", 1)  # positional, as a function


def test_the_default_server_lists_search_alone():
    from mt_grpo.tools.kb_mcp_server import build_server

    assert [t.name for t in asyncio.run(build_server(seed=0, crashable=False).list_tools())] == ["search"]


def test_an_error_result_raises_with_the_servers_text(stdio_tools, http_tools):
    for tools in (stdio_tools, http_tools):
        with pytest.raises(MCPToolError, match="search: the query is empty; pass the words to look up"):
            tools["search"](query="  ")


def test_a_call_that_does_not_fit_the_signature_is_a_type_error(stdio_tools):
    """As for a Python tool: the trainer reports it as bad arguments, and nothing reaches the server."""
    with pytest.raises(TypeError, match="missing a required argument: 'query'"):
        stdio_tools["search"](num_results=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'limit'"):
        stdio_tools["search"](query="x", limit=2)


def test_concurrent_calls_share_the_session(stdio_tools, http_tools, local_search):
    """As the trainer runs a round's calls: many threads at once, on one session per server."""
    queries = [f"capital of {name}" for name in ("Ratomora", "Veltria", "Kalosh", "Morvane")] * 4
    calls = [ToolCall("search", {"query": q}) for q in queries]
    for tools in (stdio_tools, http_tools):
        results = run_tool_calls(tools, calls, timeout=TIMEOUT, max_workers=16)
        assert [r.output for r in results] == [local_search(query=q) for q in queries]
        assert all(r.ok for r in results)


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_slow_call_times_out_promptly_and_the_server_goes_on(request, transport):
    """The call waits TIMEOUT, not the tool's 60 s: the error says so (it is raised by that wait, and the test's own
    timeout would stop a hang); no wall-clock assertion, which a loaded machine could fail."""
    tools = request.getfixturevalue(f"{transport}_tools")
    with pytest.raises(TimeoutError, match=f"MCP tool 'sleep' of server .* gave no result within {TIMEOUT:g}s"):
        tools["sleep"](seconds=60)
    assert tools["sleep"](seconds=0.1) == "slept 0.1s"
    assert tools["search"](query="capital of Ratomora").startswith(RATOMORA)


# ------------------------------------------------------------------------------------------------
# a crash, and the restart after it
# ------------------------------------------------------------------------------------------------
def test_a_crashed_stdio_server_fails_the_next_call_at_once_and_is_restarted_after(stdio_tools):
    with pytest.raises(MCPServerDown, match="is down: .*; the next call will restart it"):
        stdio_tools["crash"]()
    assert stdio_tools["search"](query="capital of Ratomora").startswith(RATOMORA)  # a new process


class Clock:
    """The retry schedule's clock (tools.mcp.clock), moved by the test: no wait depends on the machine's speed."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_http_server_that_goes_down_fails_calls_at_once_and_is_reconnected_when_back(monkeypatch):
    """Servers of its own, and a clock the test moves. The call that crashes one fails at once; the next one tries
    to reconnect, finds nothing listening and fails; calls before the next try (1 s later) fail without trying;
    the try at 1 s fails too, and the next waits 2 s. A server started again on the port is reconnected to at the
    next try. One restarted between two calls has forgotten the session: the first call after fails, the next
    reconnects at once."""
    clock = Clock()
    monkeypatch.setattr("mt_grpo.tools.mcp.clock", clock)
    port = free_port()
    with http_server(port) as url:
        tools = {fn.__name__: fn for fn in mcp_tools([url], timeout=TIMEOUT)}
        with pytest.raises(MCPServerDown, match="is down: .*; the next call will reconnect it"):
            tools["crash"]()
        with pytest.raises(MCPServerDown, match="the reconnect failed: ConnectError.*; calls fail at once until the "
                                                "next try, 1s after it"):
            tools["search"](query="capital of Ratomora")
    clock.now += 0.9
    with http_server(port):  # back, but before the next try: not tried
        with pytest.raises(MCPServerDown, match="calls fail at once until the next try, 1s after it"):
            tools["search"](query="capital of Ratomora")
    clock.now += 0.1
    with pytest.raises(MCPServerDown, match="the reconnect failed: ConnectError.*next try, 2s after it"):
        tools["search"](query="capital of Ratomora")  # tried at 1 s, nothing listening: the wait doubles
    with http_server(port):
        clock.now += 2.0
        assert tools["search"](query="capital of Ratomora").startswith(RATOMORA)
    with http_server(port):
        with pytest.raises(MCPServerDown, match="is down: it stopped answering"):
            tools["search"](query="capital of Ratomora")
        assert tools["search"](query="capital of Ratomora").startswith(RATOMORA)  # the schedule starts over


USER_SERVER = '''
import sys
sys.path.insert(0, {root!r})
from mcp.server.mcpserver import MCPServer
from mt_grpo.tools.mcp import errors_for_the_model


def convert_units(value: float, unit: str) -> str:
    """Convert a length to metres.

    Args:
        value: the length.
        unit: its unit, m or km.
    """
    factors = {{"m": 1.0, "km": 1000.0}}
    if unit not in factors:
        raise ValueError(f"unknown unit {{unit!r}}; use one of {{', '.join(factors)}}")
    return f"{{value * factors[unit]:g}} m"


def convert_units_unwrapped(value: float, unit: str) -> str:
    """The same, without the wrapper.

    Args:
        value: the length.
        unit: its unit, m or km.
    """
    return convert_units(value, unit)


server = MCPServer("units", log_level="WARNING")
server.add_tool(errors_for_the_model(convert_units))
server.add_tool(convert_units_unwrapped)
server.run("stdio")
'''


def test_a_users_tool_error_reaches_the_model_with_its_message(tmp_path):
    """A user's own server, started with `python` as a shell would not have it (the trainer's interpreter runs it).
    Its tool raises ValueError: wrapped by errors_for_the_model, the model reads the message; unwrapped, the SDK
    keeps it on the server."""
    script = tmp_path / "units_server.py"
    script.write_text(USER_SERVER.format(root=ROOT))
    tools = {fn.__name__: fn for fn in mcp_tools([f"python {script}"], timeout=10.0)}
    assert tools["convert_units"](value=2, unit="km") == "2000 m"
    calls = [ToolCall("convert_units", {"value": 2, "unit": "mi"}),
             ToolCall("convert_units_unwrapped", {"value": 2, "unit": "mi"})]
    wrapped, unwrapped = run_tool_calls(tools, calls, timeout=10.0, max_workers=2)
    assert wrapped.output == ("Error: tool 'convert_units' raised MCPToolError: ValueError: unknown unit 'mi'; use "
                              "one of m, km")
    assert unwrapped.output == ("Error: tool 'convert_units_unwrapped' raised MCPToolError: Error executing tool "
                                "convert_units_unwrapped")


def test_the_guides_mcp_commands_run_as_written(monkeypatch):
    """docs/guide.md's MCP example, from the repository's root: the stdio entry of its recipe line, and the shell
    command that starts the HTTP server (on a free port instead of 8765), each serving `search`."""
    with open(os.path.join(ROOT, "docs", "guide.md")) as f:
        guide = f.read()
    section = guide[guide.index("**Tools behind MCP servers.**"):guide.index("## LLM-judge rewards")]
    stdio = re.search(r'^mcp_servers: \["(.+?)"\]', section, re.MULTILINE).group(1)
    shell = re.search(r"^(\.venv/bin/python mt_grpo/tools/kb_mcp_server.py --transport http --port 8765)", section,
                      re.MULTILINE).group(1)
    monkeypatch.chdir(ROOT)
    tools = {fn.__name__: fn for fn in mcp_tools([stdio], timeout=TIMEOUT)}
    assert tools["search"](query="capital of Ratomora").startswith(RATOMORA)
    port = free_port()
    with http_server(port, command=shlex.split(shell.replace("8765", str(port)))) as url:
        http = {fn.__name__: fn for fn in mcp_tools([url], timeout=TIMEOUT)}
        assert http["search"](query="capital of Ratomora").startswith(RATOMORA)


# ------------------------------------------------------------------------------------------------
# servers that do not start, and entries that are not servers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry, problem, fix", [
    ("no-such-mcp-server --seed 0", "FileNotFoundError", "check that `no-such-mcp-server` is installed and on PATH"),
    (shlex.join([sys.executable, "-c", "import sys; sys.stderr.write('no config file'); sys.exit(3)"]),
     "Connection closed", "it ends:\nno config file"),  # the server's stderr, quoted
    ("http://127.0.0.1:{port}/mcp", "ConnectError", "Start the server first"),
])
def test_a_server_that_does_not_start_is_named_with_the_fix(entry, problem, fix):
    entry = entry.format(port=free_port())
    with pytest.raises(ValueError) as e:
        mcp_tools([entry], timeout=TIMEOUT)
    message = str(e.value)
    assert message.startswith(f"MCP server {entry!r} (mcp_servers) did not start: ")
    assert problem in message and fix in message


def test_a_server_that_never_answers_fails_after_the_start_timeout():
    silent = shlex.join([sys.executable, "-c", "import sys; sys.stdin.read()"])  # reads, never answers
    with pytest.raises(ValueError, match="did not answer `initialize` within 1s"):
        mcp_tools([silent], timeout=TIMEOUT, start_timeout=1.0)


def test_two_servers_with_a_tool_of_one_name_are_named(http_url):
    other = http_url + "?copy=2"  # the same process under a second URL: two entries, and no server to start
    with pytest.raises(ValueError, match=re.escape(f"MCP servers {http_url!r} and {other!r} both have a tool named "
                                                   "'search'")):
        mcp_tools([http_url, other], timeout=TIMEOUT)
    with pytest.raises(ValueError, match=re.escape(f"mcp_servers lists {http_url!r} twice")):
        mcp_tools([http_url, http_url], timeout=TIMEOUT)


@pytest.mark.parametrize("entry, command, env, url", [
    ("python server.py --seed 0", [sys.executable, "server.py", "--seed", "0"], {}, ""),  # the trainer's python
    ("/usr/bin/python3 server.py", ["/usr/bin/python3", "server.py"], {}, ""),  # a path: as written
    ("https://example.org/mcp", [], {}, "https://example.org/mcp"),
    ({"command": ["python3", "server.py"], "env": {"KEY": "1"}}, [sys.executable, "server.py"], {"KEY": "1"}, ""),
    ({"command": "node 'my server.js'"}, ["node", "my server.js"], {}, ""),
    ({"url": "http://127.0.0.1:8000/mcp"}, [], {}, "http://127.0.0.1:8000/mcp"),
])
def test_server_entries(entry, command, env, url):
    spec = parse_server(entry)
    assert (spec.command, spec.env, spec.url) == (command, env, url)


@pytest.mark.parametrize("entry", ["", 3, [], {"url": "ftp://x"}, {"command": []}, {"command": ["x"], "port": 1},
                                   {"command": ["x"], "env": {"N": 1}}])
def test_an_entry_that_is_not_a_server_is_named(entry):
    with pytest.raises(ValueError, match=re.escape(f"mcp_servers entry {entry!r} is not a server; write a command")):
        parse_server(entry)


# ------------------------------------------------------------------------------------------------
# the mcpServers map: Claude Desktop's / verl's mcp_server.json, with tokens and tool filters
# ------------------------------------------------------------------------------------------------
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured():
    """{"sse": url, "http": url} of two servers that answer 401 without `Authorization: Bearer TOKEN`."""
    with http_server(transport="sse", token=TOKEN) as sse, http_server(transport="http", token=TOKEN) as http:
        yield {"sse": sse, "http": http}


def test_a_servers_map_connects_stdio_http_and_sse_with_their_filters_and_tokens(secured, local_search, monkeypatch):
    """One map, as Claude Desktop and verl write it: a stdio server (command, args, env), an SSE server with verl's
    auth_token (from the environment, as `${VAR}`), a streamable-HTTP one with the header written out. Each
    server's includeTools keeps a different tool, so that three copies of one server give three tools; the call
    reaches each server."""
    monkeypatch.setenv("KB_TOKEN", TOKEN)
    config = {"mcpServers": {
        "kb-stdio": {"command": "python", "args": [SERVER, "--seed", "0", "--crashable"], "env": {"UNUSED": "1"},
                     "includeTools": ["sleep"], "description": "read by editors only"},
        "kb-sse": {"url": secured["sse"], "auth_token": "${KB_TOKEN}", "includeTools": ["search"]},
        "kb-http": {"url": secured["http"], "type": "http", "headers": {"Authorization": f"Bearer {TOKEN}"},
                    "excludeTools": ["search", "sleep"]},
        "off": {"command": "no-such-server", "disabled": True},  # Cline's switch: never started
    }}
    tools = {fn.__name__: fn for fn in mcp_tools_from_map(config, None, timeout=TIMEOUT)}
    assert {name: fn.mcp_server for name, fn in tools.items()} == {"sleep": "kb-stdio", "search": "kb-sse",
                                                                   "crash": "kb-http"}
    assert tools["search"](query="capital of Ratomora") == local_search(query="capital of Ratomora")
    assert tools["sleep"](seconds=0.01) == "slept 0.01s"
    # mcp_tool_filter (verl's tool_selected_list), over the map without its top-level key: the rest never reach
    # the model, and the servers left with no tool are not kept
    (search,) = mcp_tools_from_map({"kb-sse": config["mcpServers"]["kb-sse"],
                                    "idle": {"url": secured["http"], "auth_token": TOKEN, "transport": "http",
                                             "excludeTools": ["search"]}},
                                   ["search"], timeout=TIMEOUT)
    assert (search.__name__, search.mcp_server) == ("search", "kb-sse")
    from mt_grpo.tools import mcp

    assert "idle" not in [server.spec.label for server in mcp._SERVERS]


@pytest.mark.parametrize("transport", ["sse", "http"])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_server_that_refuses_the_connection_asks_for_its_token(secured, transport, token):
    entry = {"url": secured[transport], "transport": transport, **({"auth_token": token} if token else {})}
    with pytest.raises(ValueError) as e:
        mcp_tools_from_map({"mcpServers": {"kb": entry}}, None, timeout=TIMEOUT)
    message = str(e.value)
    assert message.startswith("MCP server 'kb' (mcp_servers_config) did not start: ")
    assert "401 Unauthorized" in message
    assert ("its token was refused" if token else "no token was sent") in message
    assert "give its token as `auth_token`" in message


def test_an_entry_with_auth_token_connects_over_sse_as_verl_does_and_the_error_says_so(secured):
    """verl sends an entry with `auth_token` over SSE whatever its URL: a streamable-HTTP server then refuses, and
    the error names the key that picks the other transport. With it, the same entry connects."""
    entry = {"url": secured["http"], "auth_token": TOKEN}
    with pytest.raises(ValueError, match=re.escape('set "transport": "http" in its entry of mcp_servers_config (an '
                                                   "entry with auth_token connects over SSE, as verl does)")):
        mcp_tools_from_map({"kb": entry}, None, timeout=TIMEOUT)
    (search,) = mcp_tools_from_map({"kb": {**entry, "transport": "http"}}, ["search"], timeout=TIMEOUT)
    assert search(query="capital of Ratomora").startswith(RATOMORA)


def test_a_filter_naming_a_tool_no_server_has_names_the_tools_there_are(http_url):
    with pytest.raises(ValueError, match=re.escape("mcp_tool_filter names ['serch'], which no MCP server has; the "
                                                   "servers' tools are ['search', 'crash', 'sleep']")):
        mcp_tools_from_map({"kb": {"url": http_url}}, ["serch"], timeout=TIMEOUT)
    with pytest.raises(ValueError, match=re.escape("MCP server 'kb' (mcp_servers_config): includeTools names "
                                                   "['find'], which it does not have; its tools are")):
        mcp_tools_from_map({"kb": {"url": http_url, "includeTools": ["find"]}}, None, timeout=TIMEOUT)
    with pytest.raises(ValueError, match="mcp_tool_filter .* no server is given"):
        mcp_tools([], TIMEOUT, selected=["search"])


def test_the_recipe_fields_read_a_json_file_and_the_prompt_shows_the_selected_tools_only(http_url, tmp_path):
    """`mcp_servers_config: path.json` and `mcp_tool_filter` through the trainer's recipe and builders, to the
    system prompt the model reads; the list form beside it."""
    import json

    from mt_grpo.run import builders
    from mt_grpo.base.fields import parse_recipe
    from helpers import RECIPE
    from mt_grpo_trainer import MTGRPOConfig

    path = tmp_path / "mcp_server.json"
    path.write_text(json.dumps({"mcpServers": {"kb": {"url": http_url}}}))
    config, _ = parse_recipe(["--config", RECIPE, "--output_dir", str(tmp_path), "--mcp_servers_config", str(path),
                              "--mcp_tool_filter", "search", "sleep"], MTGRPOConfig)
    tools = builders._mcp_tools(config)
    assert [t.__name__ for t in tools] == ["search", "sleep"]
    prompt = XMLProtocol().system_prompt(tools)
    assert "- search(query: str" in prompt and "- sleep(seconds" in prompt and "- crash(" not in prompt
    with pytest.raises(ValueError, match="MCP servers '.*' and 'kb' both have a tool named 'search'"):
        builders._mcp_tools(SimpleNamespace(mcp_servers=[http_url], mcp_servers_config=str(path), tool_timeout=TIMEOUT,
                                            mcp_tool_filter=None, mcp_startup_timeout=None))


@pytest.mark.parametrize("entry, transport, headers", [
    ({"url": "https://x.org/sse"}, "sse", {}),  # fastmcp's and the MCP clients' rule: the path says SSE
    ({"url": "https://x.org/sse/"}, "sse", {}),
    ({"url": "https://x.org/mcp"}, "http", {}),
    ({"url": "https://x.org/mcp", "auth_token": "t"}, "sse", {"Authorization": "Bearer t"}),  # as verl connects it
    ({"url": "https://x.org/mcp", "auth": "t", "type": "streamable-http"}, "http", {"Authorization": "Bearer t"}),
    ({"url": "https://x.org/sse", "transport": "http"}, "http", {}),  # a key names it: as written
    ({"url": "https://x.org/mcp", "type": "sse", "headers": {"X-Key": "k"}}, "sse", {"X-Key": "k"}),
    ({"httpUrl": "https://x.org/sse"}, "http", {}),  # Gemini CLI's key for streamable HTTP
    ({"command": "node", "args": ["server.js"], "type": "stdio"}, "stdio", {}),
])
def test_a_map_entrys_transport_and_headers(entry, transport, headers):
    spec = parse_map_entry("s", entry)
    assert (spec.transport, spec.headers) == (transport, headers)


def test_a_map_entry_expands_environment_variables_and_runs_python_here(monkeypatch):
    monkeypatch.setenv("KB_SEED", "3")
    monkeypatch.delenv("NOT_SET", raising=False)
    spec = parse_map_entry("kb", {"command": "python", "args": ["server.py", "--seed", "${KB_SEED}"],
                                  "env": {"MODE": "${NOT_SET:-test}"}, "cwd": "/tmp"})
    assert (spec.command, spec.env, spec.cwd) == ([sys.executable, "server.py", "--seed", "3"], {"MODE": "test"},
                                                  "/tmp")
    assert parse_map_entry("kb", {"command": "x", "disabled": True}) is None


@pytest.mark.parametrize("entry, message", [
    ({"command": "x", "port": 1}, "has key(s) ['port'], which this trainer does not read; remove them"),
    ({"url": "http://x/mcp", "command": "x"}, "needs either a `command` (a stdio server) or a `url`"),
    ({"args": ["x"]}, "needs either a `command`"),
    ({"url": "http://x/mcp", "type": "websocket"}, "has transport 'websocket'; write one of"),
    ({"url": "ftp://x"}, "url 'ftp://x' is not an http(s) URL"),
    ({"url": "http://x/mcp", "auth": "oauth"}, "auth 'oauth' is not supported"),
    ({"url": "http://x/mcp", "auth_token": "t", "headers": {"authorization": "Bearer u"}}, "keep one"),
    ({"command": "x", "env": {"N": 1}}, "`env` is a map of strings (quote numbers"),
    ({"command": "x", "args": "--flag"}, "`args` a list of strings"),
    ({"url": "http://x/mcp", "headers": {"Authorization": "Bearer ${NOT_SET}"}}, "uses ${NOT_SET}, and the "
                                                                                  "environment has no NOT_SET"),
    ({"command": "x", "includeTools": "search"}, "includeTools is a list of tool names"),
])
def test_a_map_entry_that_cannot_run_as_written_is_named_with_the_fix(entry, message, monkeypatch):
    monkeypatch.delenv("NOT_SET", raising=False)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        parse_map_entry("s", entry)
    assert str(e.value).startswith("MCP server 's' (mcp_servers_config)")


@pytest.mark.parametrize("config, message", [
    ("/no/such/mcp_server.json", "mcp_servers_config: no file '/no/such/mcp_server.json'"),
    (["python server.py"], "mcp_servers_config is ['python server.py'], not a map of servers"),
    ({"mcpServers": {"kb": "python server.py"}}, "not a map of servers"),
])
def test_a_config_that_is_not_a_servers_map_is_named(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mcp_tools_from_map(config, None, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------
# what the model sees: signatures and schemas in both tool formats
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema, signature", [
    ({"properties": {"query": {"type": "string"}}, "required": ["query"]}, "(query: str) -> str"),
    ({"properties": {"n": {"type": "integer", "default": 3}, "query": {"type": "string"}}, "required": ["query"]},
     "(query: str, n: int = 3) -> str"),  # required first
    ({"properties": {"a": {"type": "number"}, "b": {"type": "boolean"}, "c": {"type": "object"}}},
     "(a: float = None, b: bool = None, c: dict = None) -> str"),
    ({"properties": {"tags": {"type": "array", "items": {"type": "string"}}, "any": {"type": "array"}}},
     "(tags: list[str] = None, any: list = None) -> str"),
    ({"properties": {"limit": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}}},
     "(limit: int | None = None) -> str"),
    ({"properties": {"limit": {"type": ["integer", "null"]}}}, "(limit: int | None = None) -> str"),
    ({"properties": {"mode": {"enum": ["fast", "slow"]}}, "required": ["mode"]},
     "(mode: Literal['fast', 'slow']) -> str"),
    ({"properties": {"x": {}}, "required": ["x"]}, "(x) -> str"),
    ({"type": "object"}, "() -> str"),
    ({"properties": {"from": {"type": "string"}, "max-results": {"type": "integer"}}}, "(**arguments) -> str"),
])
def test_tool_signature_from_the_input_schema(schema, signature):
    assert str(tool_signature(schema)).replace("typing.", "") == signature


def test_neutral_arguments_read_a_signature_without_type_hints():
    """An MCP tool's types may live in its `__signature__` alone; the placeholders follow them."""
    def tool(**arguments):
        return ""

    tool.__signature__ = tool_signature({"properties": {
        "count": {"type": "integer"}, "flag": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]},
        "tags": {"type": "array", "items": {"type": "number"}}, "limit": {"type": "integer"}},
        "required": ["count", "flag", "mode", "tags"]})
    assert neutral_arguments(tool) == {"count": 1, "flag": True, "mode": "fast", "tags": [1.5]}


def test_neutral_arguments_of_the_servers_tools(stdio_tools):
    assert neutral_arguments(stdio_tools["search"]) == {"query": "..."}
    assert neutral_arguments(stdio_tools["sleep"]) == {"seconds": 1.5}


def test_the_xml_prompt_describes_the_servers_search_as_the_local_one(stdio_tools, local_search):
    search = stdio_tools["search"]
    # each argument's description too: from the local docstring's schema, and from the Args section of the
    # description the server sends (its input schema has none)
    assert describe_tools([search]) == describe_tools([local_search]) == (
        "- search(query: str, num_results: int = 3) -> str: Search the knowledge base and return the best-matching "
        "documents.\n    query: words to look up, e.g. \"capital of Veltria\".\n"
        "    num_results: how many documents to return, from 1 to 10.")
    assert XMLProtocol().system_prompt([search]) == XMLProtocol().system_prompt([local_search])


def test_the_chat_template_gets_the_servers_schema(stdio_tools, qwen_style_tokenizer):
    tools = list(stdio_tools.values())
    protocol = get_protocol("chat_template")
    assert tool_schemas(tools) == protocol.template_tools(tools) == [fn.json_schema for fn in tools]
    text = qwen_style_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                    tools=protocol.template_tools(tools), tokenize=False,
                                                    add_generation_prompt=True)
    assert '"parameters": {"properties": {"query": {"title": "Query", "type": "string"}' in text
    assert '"name": "sleep"' in text


# ------------------------------------------------------------------------------------------------
# through the trainer's rollout loop
# ------------------------------------------------------------------------------------------------
def test_an_episode_calls_the_servers_search(stdio_tools, smollm2_tokenizer):
    tools = list(stdio_tools.values())
    env = make_env(smollm2_tokenizer, tools, max_tool_response_tokens=400, max_completion_length=800)
    script = {QUESTION: [xml_call("capital of Ratomora"), xml_answer("Lotrowick")]}
    (episode,) = env.rollout([env.prompt(QUESTION)], ScriptedPolicy(smollm2_tokenizer, script))
    assert episode.messages[1] == {"role": "tool", "name": "search",
                                   "content": stdio_tools["search"](query="capital of Ratomora")}
    assert episode.messages[1]["content"].startswith(RATOMORA)
    assert (episode.stop_reason, episode.tool_turns, episode.tool_failures) == ("answer", 1, 0)


def test_an_episode_goes_on_past_a_crashed_server(stdio_tools, smollm2_tokenizer):
    """The call that finds the server down is an error the model sees; its next call runs on the new process."""
    tools = list(stdio_tools.values())
    env = make_env(smollm2_tokenizer, tools, max_env_steps=3, max_tool_response_tokens=400,
                   max_completion_length=1200)
    crash = '<reasoning>Break it.</reasoning>\n<tool>{"name": "crash", "args": {}}</tool>'
    script = {QUESTION: [crash, xml_call("capital of Ratomora"), xml_answer("Lotrowick")]}
    (episode,) = env.rollout([env.prompt(QUESTION)], ScriptedPolicy(smollm2_tokenizer, script))
    replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert replies[0].startswith("Error: tool 'crash' raised MCPServerDown: MCP server ")
    assert "is down" in replies[0]
    assert replies[1].startswith(RATOMORA)
    assert (episode.stop_reason, episode.tool_turns, episode.tool_failures) == ("answer", 2, 1)


# ------------------------------------------------------------------------------------------------
# through the recipe: a training run whose only tool is the server's
# ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_recipe_trains_with_the_servers_search(request, transport, tiny_agent_dir, tmp_path):
    import yaml

    from helpers import RECIPE, final_metrics, rollout_records, run

    server = STDIO if transport == "stdio" else request.getfixturevalue("http_url")
    with open(RECIPE) as f:
        recipe = {**yaml.safe_load(f), "tools": [], "mcp_servers": [server], "max_steps": 1, "max_samples": 8,
                  "per_device_train_batch_size": 4, "save_rollouts_steps": 1}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", str(tmp_path / "recipe.yaml"), "--model_name_or_path",
         tiny_agent_dir, "--output_dir", out], tmp_path)
    assert len([h for h in final_metrics(out) if "loss" in h]) == 1
    records = rollout_records(out)
    assert "- search(query: str, num_results: int = 3) -> str:" in records[0]["prompt_text"]
    outputs = [c["output"] for r in records for t in r["turns"] if t["role"] == "env" for c in t["tool_calls"]
               if c["name"] == "search" and c["ok"]]
    assert all(not o.startswith("Error") for o in outputs)
