"""The tools the agent can call, by name.

A tool is a plain function with typed keyword arguments that returns a string. The trainer renders
its signature and the first line of its docstring into the system prompt, and the model calls it by
its function name (`__name__`): `<tool>{"name": "<function name>", "args": {...}}</tool>`. On failure a
tool raises an exception with a message that says what went wrong: the environment shows it to the
model as `Error: ...` and counts a failed call. The trainer bounds each call with `tool_timeout`, so a
tool need not.

To add a tool: write the function in a module under `tools/` (docstring: one line saying what it
does, then an `Args:` section with one line per argument), then either add one line
`"my_tool": "tools.my_module:my_tool"` to TOOLS below and list the name in the recipe's `tools`, or
list its dotted path there (`tools.my_module:my_tool`, or any importable module). registry.py
resolves both, as it does for rewards; an unknown name fails with the list of valid names.

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

import asyncio
import concurrent.futures
import inspect
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from protocol import ToolCall, error_text
from registry import resolve

# A tool or reward may use JAX (bm25s did, at import: tools/search.py). JAX's GPU backend reserves 75% of the
# card when it starts, inside the trainer's process, where the policy needs it; JAX reads this when its backend
# starts, and the trainer imports this module before any tool exists. A user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# name in the recipe -> `module:function`. The name is the one the model calls (the tool's __name__), and a
# module is imported only when a recipe names its tool.
TOOLS: dict[str, str] = {
    "search": "tools.search:make_search_tool",  # offline BM25 over the task's corpus; a corpus tool
    "wiki_search": "tools.wiki_search:wiki_search",  # English Wikipedia summaries; needs the network
}


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
        if called in first_with:
            raise ValueError(f"Tools '{first_with[called]}' and '{name}' are both functions named '{called}', and "
                             "the model calls a tool by its function name. Rename one of the functions.")
        first_with[called] = name
    return tools


def _function_tool(fn) -> Callable:
    """A tool passed as an object (the Python API): a function, not a corpus tool's factory."""
    if not callable(fn):
        raise ValueError(f"`tools` holds a {type(fn).__name__} ({fn!r}); give functions, or names of tools/.")
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


@dataclass
class ToolResult:
    output: str
    ok: bool
    seconds: float = 0.0


def run_tool_calls(tools: dict[str, Callable], calls: list[ToolCall], timeout: float,
                   max_workers: int) -> list[ToolResult]:
    """Run tool calls concurrently, `max_workers` at a time, each bounded by `timeout` seconds. A
    failure becomes an `Error: ...` output the model sees. Calls run on daemon threads, so a tool that
    never returns is abandoned after its timeout and can neither stall later calls nor keep the
    process alive at exit. Tools get parsed JSON arguments only; malformed calls are not run."""
    results: list[ToolResult] = [ToolResult("", False)] * len(calls)
    timed_out: set[int] = set()

    def call(i: int, fn: Callable, args: dict):
        start = time.monotonic()
        try:
            output = run_async(fn(**args))  # an async tool (an environment's async method): on the shared loop
            results[i] = ToolResult(str(output), True, time.monotonic() - start)
        except TypeError as e:
            results[i] = ToolResult(error_text(f"bad arguments for tool '{calls[i].name}': {e}"), False,
                                    time.monotonic() - start)
        except Exception as e:  # the model sees the error and the turn reward counts a failure
            results[i] = ToolResult(error_text(f"tool '{calls[i].name}' raised {type(e).__name__}: {e}"),
                                    False, time.monotonic() - start)

    for start in range(0, len(calls), max_workers):
        wave, deadline = [], time.monotonic() + timeout
        for i in range(start, min(start + max_workers, len(calls))):
            if calls[i].error:
                results[i] = ToolResult(error_text(calls[i].error), False)
            elif calls[i].name not in tools:
                results[i] = ToolResult(
                    error_text(f"unknown tool '{calls[i].name}'; available tools: {sorted(tools)}"), False)
            else:
                thread = threading.Thread(target=call, args=(i, tools[calls[i].name], calls[i].arguments),
                                          daemon=True)
                thread.start()
                wave.append((i, thread))
        for i, thread in wave:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                timed_out.add(i)
    # A timed-out thread may still finish and write its slot later: answer from a snapshot.
    final = list(results)
    for i in timed_out:
        final[i] = ToolResult(error_text(f"tool '{calls[i].name}' timed out after {timeout:g}s"), False,
                              timeout)
    return final


async def _as_coroutine(awaitable):
    return await awaitable


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop on a daemon thread for every async tool and MCP session (tools/mcp.py), started on first use
    (as TRL runs async tools and rewards): an object an async method keeps (a client session) stays on the loop
    that made it."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="async-tools", daemon=True).start()
        return _LOOP


def run_async(value):
    """`value`, awaited on the shared loop if it is awaitable (an async `get_reward`); as is otherwise."""
    if not inspect.isawaitable(value):
        return value
    return asyncio.run_coroutine_threadsafe(_as_coroutine(value), event_loop()).result()


@dataclass
class Toolset:
    """The tools one episode may call: `functions` by the name the model calls, `template_tools` their schemas
    for the chat template (Protocol.template_tools). Without an `environment` the tools are stateless and calls
    run concurrently; an environment's methods share its state, so its calls run one at a time, in order
    (environments.py). `turn_rewards`: per tool turn run, what the environment reported (its step rewards)."""

    functions: dict[str, Callable]
    template_tools: list[dict] | None = None
    environment: object = None
    turn_rewards: list[list[float]] = field(default_factory=list)

    def run(self, calls: list[ToolCall], timeout: float, max_workers: int) -> list[ToolResult]:
        """One model turn's calls."""
        if self.environment is None:
            return run_tool_calls(self.functions, calls, timeout, max_workers)
        steps = getattr(self.environment, "step_rewards", None)
        before = len(steps) if isinstance(steps, list) else 0
        results = [run_tool_calls(self.functions, [call], timeout, 1)[0] for call in calls]
        steps = getattr(self.environment, "step_rewards", None)
        self.turn_rewards.append(list(steps[before:]) if isinstance(steps, list) else [])
        return results


def run_turns(turns: list[tuple[Toolset, list[ToolCall]]], timeout: float,
              max_workers: int) -> list[list[ToolResult]]:
    """The results of several episodes' turns, each turn's calls run by its Toolset. The turns of one stateless
    toolset run as one batch of concurrent calls; each environment's turn runs on its own thread, beside them."""
    results: list[list[ToolResult] | None] = [None] * len(turns)
    by_toolset: dict[int, list[int]] = {}
    for i, (toolset, _) in enumerate(turns):
        by_toolset.setdefault(id(toolset), []).append(i)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(max_workers, len(turns))),
                                               thread_name_prefix="env-turns") as pool:
        stateful = {pool.submit(turns[i][0].run, turns[i][1], timeout, max_workers): i
                    for i, (toolset, _) in enumerate(turns) if toolset.environment is not None}
        for indices in by_toolset.values():
            toolset = turns[indices[0]][0]
            if toolset.environment is None:
                flat = toolset.run([c for i in indices for c in turns[i][1]], timeout, max_workers)
                for i in indices:
                    results[i], flat = flat[: len(turns[i][1])], flat[len(turns[i][1]):]
        for future, i in stateful.items():
            results[i] = future.result()
    return results
