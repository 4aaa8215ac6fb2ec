"""The fictional knowledge base's `search` tool as an MCP server (the `mcp` package's MCPServer, the FastMCP
of mcp 1.x), for `mcp_servers` in a recipe and for the tests of mt_grpo/tools/mcp.py.

It serves the same BM25 `search` that mt_grpo/tools/search.py builds in process, over the knowledge base of
`--seed` (mt_grpo/tasks/fictional_kb.py), so a run that gets `search` from this server shows the model the same
tool.

    .venv/bin/python mt_grpo/tools/kb_mcp_server.py --seed 0                        # stdio (what `mcp_servers` starts)
    .venv/bin/python mt_grpo/tools/kb_mcp_server.py --transport http --port 8765    # streamable HTTP at /mcp
    .venv/bin/python mt_grpo/tools/kb_mcp_server.py --transport sse --port 8766 --token s3cret   # SSE at /sse, with a token
    mcp_servers: [".venv/bin/python mt_grpo/tools/kb_mcp_server.py --seed 0"]       # in a recipe
    mcp_servers: ["http://127.0.0.1:8765/mcp"]

(In `mcp_servers`, a leading `python` also runs with the trainer's interpreter, mt_grpo/tools/mcp.py; in a shell, the
venv's python has the `mcp` package.) Its tools are wrapped by `errors_for_the_model`, so that the model reads
the message of any exception a tool raises (an empty query, say).

`--crashable` adds tools that only tests want: `crash()` kills the server and `sleep(seconds)` answers late.
Without the flag the server lists `search` alone. `--token T` (HTTP and SSE) refuses every request without the
header `Authorization: Bearer T` (401), as a hosted server does: `auth_token: T` in an mcp_servers_config entry
sends it.
"""

import argparse
import asyncio
import inspect
import os
import sys

# Run as a script, Python puts mt_grpo/tools/ first on sys.path, where its mcp.py would shadow the `mcp` package; the
# folder that holds the `mt_grpo` package (the repository root, or site-packages) takes its place.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcp.server.mcpserver import MCPServer  # noqa: E402

from mt_grpo.tasks.fictional_kb import build_fictional_kb  # noqa: E402
from mt_grpo.tools.mcp import errors_for_the_model  # noqa: E402
from mt_grpo.tools.search import make_search_tool  # noqa: E402


def crash() -> str:
    """Kill this server at once, as a crash would (a test tool: only with --crashable)."""
    os._exit(1)


async def sleep(seconds: float) -> str:
    """Wait, then answer (a test tool: only with --crashable).

    Args:
        seconds: how long to wait before answering.
    """
    await asyncio.sleep(seconds)  # async: the server goes on answering other calls meanwhile
    return f"slept {seconds:g}s"


def build_server(seed: int, crashable: bool) -> MCPServer:
    documents, _ = build_fictional_kb(seed=seed)
    # WARNING: at INFO the server logs every failed call, and uvicorn every HTTP request
    server = MCPServer("fictional-kb", log_level="WARNING")
    tools = [errors_for_the_model(make_search_tool(documents))] + ([crash, sleep] if crashable else [])
    for tool in tools:
        # the docstring without its indentation; plain text results, as the in-process tools return
        server.add_tool(tool, description=inspect.getdoc(tool), structured_output=False)
    return server


def bearer_only(app, token: str):
    """The ASGI `app`, answering 401 to any HTTP request without `Authorization: Bearer <token>`."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": b"a bearer token is required"})
            return
        await app(scope, receive, send)

    return guarded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="The knowledge base's seed (the task's `seed`).")
    parser.add_argument("--transport", choices=["stdio", "http", "sse"], default="stdio",
                        help="stdio: talk over stdin/stdout (started by the trainer); http: streamable HTTP at /mcp; "
                             "sse: the older SSE transport at /sse.")
    parser.add_argument("--host", default="127.0.0.1", help="With --transport http: the address to listen on.")
    parser.add_argument("--port", type=int, default=8765, help="With --transport http: the port to listen on.")
    parser.add_argument("--crashable", action="store_true", help="Add the test tools `crash` and `sleep`.")
    parser.add_argument("--token", default=None, help="With http or sse: refuse requests without this bearer token.")
    args = parser.parse_args(argv)
    server = build_server(args.seed, args.crashable)
    if args.transport == "stdio":
        server.run("stdio")
    elif args.token is None:
        server.run("streamable-http" if args.transport == "http" else "sse", host=args.host, port=args.port)
    else:  # the SDK's app behind the token check, served as its own `run` would serve it
        import uvicorn

        app = server.streamable_http_app(host=args.host) if args.transport == "http" else server.sse_app(host=args.host)
        uvicorn.run(bearer_only(app, args.token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
