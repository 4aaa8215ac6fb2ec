"""The tools the agent can call, by name.

A tool is a plain function with typed keyword arguments that returns a string. The trainer renders
its signature and the first line of its docstring into the system prompt, and the model calls it as
`<tool>{"name": "<function name>", "args": {...}}</tool>`. On failure a tool raises an exception with
a message that says what went wrong: the environment shows it to the model as `Error: ...` and
counts a failed call. The trainer bounds each call with `tool_timeout`, so a tool need not.

To add a tool: write the function in a module under `tools/` (docstring: one line saying what it
does, then an `Args:` section with one line per argument), add its name to TOOL_NAMES and a branch
to `build_tools` below, and list the name in the recipe's `tools`.

    search        offline BM25 over the task's corpus (tools/search.py); needs a corpus
    wiki_search   English Wikipedia summaries (tools/wiki_search.py); needs the network
"""

from typing import Callable

TOOL_NAMES = ["search", "wiki_search"]


def build_tools(names: list[str], corpus: list[dict] | None) -> list[Callable]:
    """The tool functions for `names` (the recipe's `tools`), in that order. `corpus` is the task's
    list of `{"title", "text"}` documents, which `search` indexes; None if the task has none."""
    unknown = [n for n in names if n not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"Unknown tool name(s) {unknown} in `tools`. Valid names: {', '.join(TOOL_NAMES)}.")
    if len(set(names)) != len(names):
        raise ValueError(f"`tools` lists a tool twice: {names}. List each tool once.")
    tools = []
    for name in names:
        # Imports here, not at the top: each tool loads its library only when a recipe asks for it.
        if name == "search":
            if corpus is None:
                raise ValueError("The `search` tool needs a corpus to search, and this task has none. Set "
                                 "`corpus_path` in the recipe to a .jsonl of {title, text} documents, or use the "
                                 "fictional_kb task (dataset_name: fictional_kb), or use `wiki_search` instead.")
            from tools.search import make_search_tool

            tools.append(make_search_tool(corpus))
        elif name == "wiki_search":
            from tools.wiki_search import wiki_search

            tools.append(wiki_search)
    return tools
