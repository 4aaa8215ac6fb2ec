"""The tools the agent can call, by name.

A tool is a plain function with typed keyword arguments that returns a string (other returns:
`mt_grpo.rollout.tool_calls.tool_output`). The
trainer renders
its signature and the first line of its docstring into the system prompt, and the model calls it by
its function name (`__name__`): `<tool>{"name": "<function name>", "args": {...}}</tool>`. On failure a
tool raises an exception with a message that says what went wrong: the environment shows it to the
model as `Error: ...` (under chat_template as TRL does, `{'error': ...}`) and counts a failed call. The trainer
bounds each call with `tool_timeout`, so a tool need not. Calls run on worker threads; a sync tool that uses `signal` runs on the main thread (MAIN, in
mt_grpo/rollout/tool_calls.py).

To add a tool: write the function in a module under `mt_grpo/tools/` (docstring: one line saying what it
does, then an `Args:` section with one line per argument), then either add one line
`"my_tool": "mt_grpo.tools.my_module:my_tool"` to TOOLS below and list the name in the recipe's `tools`, or
list its dotted path there (`mt_grpo.tools.my_module:my_tool`, or any importable module, your own too).
mt_grpo/base/registry.py resolves both, as it does for rewards; an unknown name fails with the list of valid
names.

A tool that needs the task's corpus (the recipe's `corpus_path`, or the task's own, as fictional_kb
has) is built from it: write a factory that takes the list of `{"title", "text"}` documents and
returns the tool, and mark it `@corpus_tool`. `build_tools` calls it once, at start-up:

    @corpus_tool
    def make_titles_tool(corpus: list[dict]) -> Callable[..., str]:
        titles = sorted(d["title"] for d in corpus)

        def list_titles(prefix: str = "") -> str:
            '''List the titles of the knowledge base's documents.

            Args:
                prefix: only the titles that start with it, e.g. "Vel".
            '''
            return ", ".join(t for t in titles if t.startswith(prefix)) or f"No title starts with {prefix!r}."

        return list_titles
"""

import inspect
import os
from dataclasses import dataclass
from typing import Callable

from mt_grpo.base.fields import Choices, arg
from mt_grpo.base.protocol import PROTOCOLS
from mt_grpo.base.registry import resolve

# A tool or reward may use JAX (bm25s did, at import: tools/search.py). JAX's GPU backend reserves 75% of the
# card when it starts, inside the trainer's process, where the policy needs it; JAX reads this when its backend
# starts, and the trainer imports this module before any tool exists. A user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# name in the recipe -> `module:function`. The name is the one the model calls (the tool's __name__), and a
# module is imported only when a recipe names its tool.
TOOLS: dict[str, str] = {
    "search": "mt_grpo.tools.search:make_search_tool",  # offline BM25 over the task's corpus; a corpus tool
    "wiki_search": "mt_grpo.tools.wiki_search:wiki_search",  # English Wikipedia summaries; needs the network
}


@dataclass
class ToolArguments:
    """The recipe keys of the tools, environments and MCP servers an episode calls; the trainer's config inherits
    them."""

    tools: list[str] | None = arg(None, "Tool names of TOOLS in mt_grpo/tools/ (search, wiki_search) or dotted "
                                  "paths `module:fn` (None: the task's: search for fictional_kb; none for your own "
                                  "data).")
    tool_format: str = arg("auto", "auto (chat_template where the chat template writes tools, as TRL runs a model's "
                           "own calls; else xml) | xml (<tool>{json}</tool>) | chat_template (the model's native tool "
                           "calls).", choices=Choices(lambda: ["auto", *sorted(PROTOCOLS)]))
    environment_factory: dict | str | None = arg(None, "TRL's environment_factory: `module:Class`, an instance per "
                                                 "episode whose public methods are tools (docs/guide.md, 'Bring your "
                                                 "own environment'); or {name: module:Class} by `environment` column.")
    mcp_servers: list[str] = arg([], "MCP servers whose tools join `tools`: stdio command lines, or server URLs "
                                 "(streamable HTTP; SSE when the path ends in /sse).")
    mcp_servers_config: dict | str | None = arg(None, "MCP servers as Claude Desktop, Cursor and verl's "
                                                "mcp_server.json write them: a .json path or the map inline, "
                                                "{mcpServers: {name: {command, args, env} | {url, headers | "
                                                "auth_token}}} (mt_grpo/tools/mcp.py).")
    mcp_tool_filter: list[str] | None = arg(None, "Only these MCP tools reach the model (verl's tool_selected_list); "
                                            "None: every tool of every server.")
    mcp_startup_timeout: float | None = arg(None, "Seconds an MCP server may take to start and answer `initialize` "
                                            "(None: the larger of tool_timeout and 30).")
    tool_images_as_user: bool = arg(False, "A tool's images go in a user message after its reply, its text staying "
                                    "in the tool message: for chat templates that drop a tool message's images but "
                                    "render a user's (checked at start; engine/vision.py). xml needs none.")
    tool_timeout: float = arg(10.0, "Seconds a tool call may run before it fails.")
    reset_timeout: float | None = arg(None, "Seconds a batch's environment resets, run at once, may take before each "
                                      "still running ends its episode unplayed (None: tool_timeout).")
    tool_max_workers: int | None = arg(None, "Tool calls (and episodes' tool turns) run at once, at most (None: all "
                                       "the batch has, so that no call waits for a worker; 64 episodes of three "
                                       "0.5 s tool turns took four waves a turn at 16).", minimum=1)
    max_user_turns: int | None = arg(None, "An environment's replies as the user (`respond`, "
                                     "mt_grpo/rollout/user_turns.py) per episode, at most (None: no limit but "
                                     "max_completion_length).", minimum=0)


def corpus_tool(factory: Callable) -> Callable:
    """Marks `factory(corpus) -> tool`: `build_tools` calls it with the task's corpus, and fails
    clearly when the task has none."""
    factory.corpus_tool = True
    return factory


def build_tools(entries: list, corpus: list[dict] | None) -> list[Callable]:
    """The tool functions for `entries` (the recipe's `tools`: names in TOOLS or dotted paths; the Python API
    may also pass the functions themselves), in that order. `corpus` is the task's list of `{"title", "text"}`
    documents, from which corpus tools are built; None if the task has none."""
    names = [e if isinstance(e, str) else getattr(e, "__name__", repr(e)) for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"`tools` lists a tool twice: {names}. List each tool once.")
    tools = [build_tool(e, corpus) if isinstance(e, str) else _function_tool(e) for e in entries]
    # The model calls a tool by its function name, so two tools with one name could not both be called.
    first_with = {}
    for name, tool in zip(names, tools):
        called = getattr(tool, "__name__", None)
        if called is None:
            raise ValueError(f"Tool '{name}' is a {type(tool).__name__} without a __name__, which the model "
                             "would call it by; make it a function (def).")
        if not called.isidentifier():
            raise ValueError(f"Tool '{name}' is named '{called}' (a lambda?), which the model cannot write as a call's "
                             "name: make it a named function (`def my_tool(x: str) -> str:` with a docstring).")
        if not (inspect.getdoc(tool) or "").strip():
            raise ValueError(f"Tool '{name}' has no docstring, and the model reads what a tool does from its first "
                             "line: write one (a line saying what it does, then `Args:` with a line per argument).")
        if called in first_with:
            raise ValueError(f"Tools '{first_with[called]}' and '{name}' are both functions named '{called}', and "
                             "the model calls a tool by its function name. Rename one of the functions.")
        first_with[called] = name
    return tools


def _function_tool(fn) -> Callable:
    """A tool passed as an object (the Python API): a function, not a corpus tool's factory."""
    if not callable(fn):
        raise ValueError(f"`tools` holds a {type(fn).__name__} ({fn!r}); give functions, or names of TOOLS "
                         "(mt_grpo/tools/).")
    if getattr(fn, "corpus_tool", False):
        raise ValueError(f"Tool '{fn.__name__}' is a corpus tool's factory: pass the tool it builds, "
                         f"`{fn.__name__}(corpus)`, or its name in `tools` with a task that has a corpus.")
    return fn


def build_tool(name: str, corpus: list[dict] | None) -> Callable:
    """One tool: the function `name` resolves to, or, for a corpus tool, what its factory builds."""
    entry = resolve(name, TOOLS, "tool")
    if not getattr(entry, "corpus_tool", False):
        return entry
    if corpus is None:
        raise ValueError(f"The `{name}` tool needs a corpus, and this task has none. Set `corpus_path` "
                         "in the recipe to a .jsonl of {title, text} documents, or use the fictional_kb task "
                         "(dataset_name: fictional_kb), or use a tool that needs no corpus, such as `wiki_search`.")
    return entry(corpus)
