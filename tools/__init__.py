"""The tools the agent can call, by name.

A tool is a plain function with typed keyword arguments that returns a string (other returns: `tool_output`). The
trainer renders
its signature and the first line of its docstring into the system prompt, and the model calls it by
its function name (`__name__`): `<tool>{"name": "<function name>", "args": {...}}</tool>`. On failure a
tool raises an exception with a message that says what went wrong: the environment shows it to the
model as `Error: ...` and counts a failed call. The trainer bounds each call with `tool_timeout`, so a
tool need not. Calls run on worker threads; a sync tool that uses `signal` runs on the main thread (MAIN, below).

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
import contextlib
import inspect
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from fields import Choices, arg
from protocol import PROTOCOLS, ToolCall, content_text, error_text, json_text
from registry import resolve
from user_turns import UserTurn, as_reply

logger = logging.getLogger("mt_grpo")

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


@dataclass
class ToolArguments:
    """The recipe keys of the tools, environments and MCP servers an episode calls; the trainer's config inherits
    them."""

    tools: list[str] | None = arg(None, "Tool names from tools/ (search, wiki_search) or dotted paths `module:fn` "
                                  "(None: the task's: search for fictional_kb; none for your own data).")
    tool_format: str = arg("xml", "xml (<tool>{json}</tool>) | chat_template (the model's native tool calls).",
                           choices=Choices(lambda: sorted(PROTOCOLS)))
    environment_factory: dict | str | None = arg(None, "TRL's environment_factory: `module:Class`, an instance per "
                                                 "episode whose public methods are tools (docs/guide.md, 'Bring your "
                                                 "own environment'); or {name: module:Class} by `environment` column.")
    mcp_servers: list[str] = arg([], "MCP servers whose tools join `tools`: stdio command lines, or server URLs "
                                 "(streamable HTTP; SSE when the path ends in /sse).")
    mcp_servers_config: dict | str | None = arg(None, "MCP servers as Claude Desktop, Cursor and verl's "
                                                "mcp_server.json write them: a .json path or the map inline, "
                                                "{mcpServers: {name: {command, args, env} | {url, headers | "
                                                "auth_token}}} (tools/mcp.py).")
    mcp_tool_filter: list[str] | None = arg(None, "Only these MCP tools reach the model (verl's tool_selected_list); "
                                            "None: every tool of every server.")
    mcp_startup_timeout: float | None = arg(None, "Seconds an MCP server may take to start and answer `initialize` "
                                            "(None: the larger of tool_timeout and 30).")
    tool_timeout: float = arg(10.0, "Seconds a tool call may run before it fails.")
    reset_timeout: float | None = arg(None, "Seconds one environment `reset` may run before its episode ends unplayed "
                                      "(None: tool_timeout).")
    tool_max_workers: int = arg(16, "Tool calls run at once, at most.")
    max_user_turns: int | None = arg(None, "An environment's replies as the user (`respond`, user_turns.py) per "
                                     "episode, at most (None: no limit but max_completion_length).")


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


# A token of a chat model's tokenizer rarely spans more characters than this (a run of spaces or of `=` may):
# a tool output is cut to max_tokens * CHARS_PER_TOKEN characters (at least MIN_WINDOW: an output that short is
# tokenized whole, as before) before it is tokenized, and the window grows only when those characters hold
# fewer tokens than kept. A 10 MB output then costs 16 KB's tokenization (milliseconds), not 10 MB's (44 s).
CHARS_PER_TOKEN, MIN_WINDOW = 16, 16_384


def cut_tool_output(text: str | list, tokenizer, max_tokens: int) -> str | list:
    """`text` cut to its first `max_tokens` tokens, with a marker saying how much was shown; as it is when
    shorter. Only a window of the text's start is tokenized (CHARS_PER_TOKEN characters a token, at least
    MIN_WINDOW, doubled while it holds too few tokens); the marker counts the tokens of the whole text when the
    window held all of it, else its characters. A tool's content list (`tool_output`) stays a list when its text
    fits, and becomes that text, cut, when it does not."""
    if isinstance(text, list):
        shown = content_text(text)
        cut = cut_tool_output(shown, tokenizer, max_tokens)
        return text if cut is shown else cut
    window = max(max_tokens * CHARS_PER_TOKEN + CHARS_PER_TOKEN, MIN_WINDOW)
    while True:
        ids = tokenizer.encode(text[:window], add_special_tokens=False)
        if window >= len(text) or len(ids) > max_tokens + 1:  # one token more: the cut cannot split a kept one
            break
        window *= 2
    if window >= len(text) and len(ids) <= max_tokens:
        return text
    kept = tokenizer.decode(ids[:max_tokens])
    shown = f"{max_tokens} of {len(ids)} tokens" if window >= len(text) else \
        f"{max_tokens} tokens of {len(text)} characters"
    return f"{kept}\n[truncated: {shown} shown]"


@dataclass
class ToolResult:
    output: str | list  # the tool message's content (tool_output)
    ok: bool
    seconds: float = 0.0
    reward: float | None = None  # the step reward of a tool that returned (output, reward)
    main_thread: bool = False  # not run: the tool uses `signal`, and the call is to run on the main thread


def tool_output(value, source: str) -> tuple[str | list, float | None]:
    """(the tool message's content, the step reward) of what a tool returned:
        str                   the text (clean_text)
        list                  the list, as TRL passes it on (content blocks `[{"type": "text", "text": ...}]`, or
                              any list): the rewards see the list, the model its text (protocol.content_text)
        (output, number)      verl's function-tool pair: `output` as here, and the number as the call's step
                              reward (the tool message's `reward`, which the `tool_rewards` turn reward reads)
        dict, number, bool,   JSON (`json.dumps(..., ensure_ascii=False)`), not Python's repr
        None, other tuples
    A value that is not JSON-able is shown with `str()`."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float)) \
            and not isinstance(value[1], bool):
        if source not in _REWARDED:
            _REWARDED.add(source)
            logger.info("%s returns (output, reward): the reward is its tool turn's step reward, which the `tool_rewards`"
                        " turn reward reads (list it in turn_reward_funcs).", source)
        return tool_output(value[0], source)[0], float(value[1])
    if isinstance(value, list):
        text = content_text(value)
        cleaned = clean_text(text, source)
        return (value if cleaned == text else cleaned), None  # text the tokenizer would refuse: the repaired text
    return clean_text(value if isinstance(value, str) else json_text(value), source), None


def run_tool_calls(tools: dict[str, Callable], calls: list[ToolCall], timeout: float,
                   max_workers: int) -> list[ToolResult]:
    """Run tool calls concurrently, `max_workers` at a time, each bounded by `timeout` seconds. A
    failure becomes an `Error: ...` output the model sees. Calls run on daemon threads, so a tool that
    never returns is abandoned after its timeout and can neither stall later calls nor keep the
    process alive at exit. Tools get parsed JSON arguments only; malformed calls are not run."""
    results: list[ToolResult] = [ToolResult("", False)] * len(calls)
    for start in range(0, len(calls), max_workers):
        wave = [start_call(tools, call) for call in calls[start:start + max_workers]]
        deadline = time.monotonic() + timeout
        for i, (thread, slot) in enumerate(wave, start):
            results[i] = finish_call(calls[i], thread, slot, max(0.0, deadline - time.monotonic()), timeout)
    for i, result in enumerate(results):  # the tools that use `signal`: one at a time, after the concurrent ones
        if result.main_thread:
            results[i] = run_on_main(tools, calls[i], timeout)
    return results


def _signature(fn: Callable) -> inspect.Signature:
    """The tool's signature; one that accepts anything where Python cannot tell (a builtin)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def start_call(tools: dict[str, Callable], call: ToolCall,
               loop: asyncio.AbstractEventLoop | None = None) -> tuple[threading.Thread | None, list[ToolResult]]:
    """(the daemon thread running `call`, the one-item list its result lands in); no thread for a call that is
    malformed or names no tool, whose error is the result at once, nor for one of a tool that uses `signal`, whose
    result says to run it on the main thread (`run_on_main`). `loop`: where an async tool runs (its environment's
    own loop; None: the shared one)."""
    if call.error:
        return None, [ToolResult(error_text(call.error), False)]
    if call.name not in tools:
        return None, [ToolResult(error_text(f"unknown tool '{call.name}'; available tools: {sorted(tools)}"), False)]
    if _function(tools[call.name]) in _SIGNAL_TOOLS:
        return None, [ToolResult("", False, main_thread=True)]
    slot: list[ToolResult] = []
    thread = threading.Thread(target=lambda: slot.append(_call(tools[call.name], call, loop)), daemon=True,
                              name=f"tool-{call.name}")
    thread.start()
    return thread, slot


def _call(fn: Callable, call: ToolCall, loop: asyncio.AbstractEventLoop | None) -> ToolResult:
    """`call` run here, on this thread; its failure as the `Error: ...` the model sees. A sync tool refused
    `signal` off the main thread is not failed: its result says to run it on the main thread."""
    begun = time.monotonic()
    try:
        _signature(fn).bind(**call.arguments)  # the arguments against the signature, so that a TypeError the
    except TypeError as e:  # tool itself raises is reported as raised, not as the model's bad arguments
        return ToolResult(error_text(f"bad arguments for tool '{call.name}': {e}"), False, time.monotonic() - begun)
    try:
        output = run_async(fn(**call.arguments), loop)  # an async tool: its environment's loop, or the shared one
        content, reward = tool_output(output, f"tool '{call.name}'")
        return ToolResult(content, True, time.monotonic() - begun, reward)
    except Exception as e:  # the model sees the error and the turn reward counts a failure
        if _refused_signal(e) and threading.current_thread() is not threading.main_thread():
            if inspect.iscoroutinefunction(_function(fn)):  # its loop's thread is never the main one
                return ToolResult(error_text(f"tool '{call.name}' uses `signal`, which works only on the main "
                                             f"thread, and async tools run on an event loop's: {SIGNAL_FIX}"), False)
            _SIGNAL_TOOLS.add(_function(fn))
            logger.warning("Tool '%s' uses `signal` (%s), which works only on the main thread: its calls run there "
                           "from now on, one at a time, after the concurrent ones, each bounded by tool_timeout "
                           "(docs/guide.md, 'Adding a tool'). To keep them concurrent: %s", call.name, e, SIGNAL_FIX)
            return ToolResult("", False, time.monotonic() - begun, main_thread=True)
        return ToolResult(error_text(f"tool '{call.name}' raised {type(e).__name__}: {e}"), False,
                          time.monotonic() - begun)


def finish_call(call: ToolCall, thread: threading.Thread | None, slot: list, wait: float,
                timeout: float) -> ToolResult:
    """The call's result after waiting up to `wait` seconds for its thread; a timeout error when it still runs
    (the thread is abandoned: a late result never reaches the model)."""
    if thread is not None:
        join(thread, wait)
        if thread.is_alive():
            return timed_out(call, timeout)
    return slot[0]


def timed_out(call: ToolCall, timeout: float) -> ToolResult:
    return ToolResult(error_text(f"tool '{call.name}' timed out after {timeout:g}s"), False, timeout)


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


def own_event_loop(name: str) -> asyncio.AbstractEventLoop:
    """A new event loop on a daemon thread of its own: an environment instance's, so that an async method of it that
    blocks (a `time.sleep`, a synchronous HTTP call) stalls only its own episode, never the others' nor MCP's."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name=f"async-{name}", daemon=True).start()
    return loop


def run_async(value, loop: asyncio.AbstractEventLoop | None = None):
    """`value`, awaited on `loop` (None: the shared loop) if it is awaitable (an async `get_reward`); as is
    otherwise. Its waits are bounded by the thread that runs it (`in_thread`, `start_call`)."""
    if not inspect.isawaitable(value):
        return value
    return asyncio.run_coroutine_threadsafe(_as_coroutine(value), loop or event_loop()).result()


def in_thread(fn: Callable[[], object], name: str) -> tuple[threading.Thread, list]:
    """(a started daemon thread running `fn()`, the list its outcome lands in: `(True, value)` or `(False, the
    exception)`), for a caller that waits a bounded time (`join`) and raises a failure on its own thread."""
    out: list = []

    def run():
        try:
            out.append((True, fn()))
        except Exception as e:  # handed to the caller, which reports it where the run reads it
            out.append((False, e))

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    return thread, out


def clean_text(value, source: str) -> str:
    """A tool's or an environment's output as text that any tokenizer takes: `str()` of a non-string (a tool's
    return goes through `tool_output` first); lone
    surrogates, NUL and other C0 controls (but tab and newline) replaced by U+FFFD, with one warning per source,
    naming it. (A lone surrogate made the tokenizer raise, naming neither the tool nor the environment.)"""
    text = value if isinstance(value, str) else str(value)
    repaired = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if _has_surrogate(text) else text
    repaired = _CONTROLS.sub("\ufffd", repaired)
    if repaired != text and source not in _REPAIRED:
        _REPAIRED.add(source)
        logger.warning("%s returned text with lone surrogates or control characters; they are shown as U+FFFD "
                       "(first time only).", source)
    return repaired


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_REPAIRED: set[str] = set()
_REWARDED: set[str] = set()  # the tools whose (output, reward) return was logged


STEP_REWARD_TYPES = (list, tuple)  # a list appended to, or a tuple replaced by a longer one
NO_STEP_REWARDS = ()  # what Toolset.step_rewards gives for an environment without them
_LOGGED_FAILURES: set[str] = set()  # the environment methods whose first failure was logged
_REPLACED: set[str] = set()  # the environment classes that replace their step_rewards list (logged once)


class StopRequested(Exception):
    """A SIGTERM asked a one-process run to stop (STOP, set by reporting.GracefulStop): raised at the rollout's
    next safe point, or from any wait below, so that no wait on user code delays the stop; the step in flight is
    dropped and reporting.stoppable saves the last finished one."""


STOP = threading.Event()


def stop_point() -> None:
    """A safe point of the rollout: StopRequested once STOP is set."""
    if STOP.is_set():
        raise StopRequested


def join(thread: threading.Thread, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
    """`thread.join(timeout)`, in slices of at most a quarter second, raising StopRequested as soon as STOP is set."""
    deadline = clock() + timeout
    while thread.is_alive() and (left := deadline - clock()) > 0:
        stop_point()
        thread.join(min(left, 0.25))
    stop_point()


# A sync tool that sets a signal handler or an alarm (TRL's grpo_agent.py tool times its query with SIGALRM;
# math_verify's parse and verify do by default) is refused on any thread but the main one: "signal only works in
# main thread". Its first call shows it; from then on its calls run on the main thread, one at a time, each bounded
# by tool_timeout through WATCHDOG (a real-time signal, so that the tool's own SIGALRM stays its own). A thread that
# is not the main one hands its call to the main thread (MAIN), which runs it where it waits for the tools: in
# run_turns (rounds) and in the per-episode scheduler's loop. A rollout beside training (async_rollout) has no such
# wait, and the call fails naming the tool and SIGNAL_FIX.
SIGNAL_REFUSED = "signal only works in main thread"
SIGNAL_FIX = ("drop the signal from the tool, as tool_timeout bounds each call (math_verify: "
              "`parse(..., parsing_timeout=None)`, `verify(..., timeout_seconds=None)`)")
WATCHDOG = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
_SIGNAL_TOOLS: set = set()  # the functions whose calls run on the main thread
_OFF_MAIN: set[str] = set()  # the tools whose call found no main thread to run on (logged once)
_ARMED = threading.Event()  # a call runs on the main thread under WATCHDOG


class _Overtime(BaseException):
    """Raised in the main thread by WATCHDOG's handler: a BaseException, so that a tool's `except Exception` does
    not take it for its own error and carry on."""


def _function(fn: Callable) -> Callable:
    """The function behind `fn` (an environment's bound method: its class's function, the same for every instance)."""
    return getattr(fn, "__func__", fn)


def _refused_signal(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from (math_verify re-raises it with its own message), is Python's
    refusal of `signal` off the main thread."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ValueError) and SIGNAL_REFUSED in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _on_watchdog(signum, frame):
    if _ARMED.is_set():
        raise _Overtime


class MainThread:
    """The calls handed to the main thread by the threads that may not run them (tools that use `signal`), run there
    while it waits in `wait`, inside `serving()`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inbox: list[tuple[Callable[[], ToolResult], concurrent.futures.Future]] = []
        self.posted = concurrent.futures.Future()  # done while the inbox holds a call
        self.depth = 0  # the main thread's `serving()` scopes open now

    @contextlib.contextmanager
    def serving(self):
        """On the main thread, the scope where it runs the calls handed to it; elsewhere, nothing."""
        main = threading.current_thread() is threading.main_thread()
        with self.lock:
            self.depth += main
        try:
            yield
        finally:
            with self.lock:
                self.depth -= main
                left, self.inbox = (self.inbox, []) if not self.depth else ([], self.inbox)
            for _, future in left:  # handed over by a call abandoned after its timeout
                if future.set_running_or_notify_cancel():
                    future.set_result(ToolResult(error_text("the rollout ended before the call ran"), False))

    def wait(self, futures, timeout: float) -> set:
        """`concurrent.futures.wait(futures, timeout, FIRST_COMPLETED)`'s done set, running meanwhile the calls handed
        to the main thread (on it)."""
        end = time.monotonic() + timeout
        while True:
            if threading.current_thread() is threading.main_thread():
                self.run_handed()
            done, _ = concurrent.futures.wait([*futures, self.posted], max(0.0, end - time.monotonic()),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            done.discard(self.posted)
            if done or time.monotonic() >= end:
                return done

    def run_handed(self) -> None:
        with self.lock:
            jobs, self.inbox = self.inbox, []
            if self.posted.done():
                self.posted = concurrent.futures.Future()
        for job, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_result(job())

    def hand_over(self, job: Callable[[], ToolResult]) -> ToolResult | None:
        """`job()`'s result, run by the main thread; None when the main thread is not serving."""
        future = concurrent.futures.Future()
        with self.lock:
            if not self.depth:
                return None
            self.inbox.append((job, future))
            if not self.posted.done():
                self.posted.set_result(None)
        while True:
            stop_point()
            try:
                return future.result(0.25)
            except concurrent.futures.TimeoutError:
                continue


MAIN = MainThread()


def run_on_main(tools: dict[str, Callable], call: ToolCall, timeout: float,
                loop: asyncio.AbstractEventLoop | None = None) -> ToolResult:
    """`call` of a tool that uses `signal`, run on the main thread (here, or handed to it), bounded by `timeout`
    seconds; an error naming the tool and the fix where no main thread can run it."""
    job = lambda: _on_main(tools[call.name], call, timeout, loop)  # noqa: E731
    if threading.current_thread() is threading.main_thread():
        return job()
    result = MAIN.hand_over(job)
    if result is None:
        if call.name not in _OFF_MAIN:
            _OFF_MAIN.add(call.name)
            logger.warning("Tool '%s' uses `signal`, which works only on the main thread, and this rollout runs off "
                           "it (async_rollout): its calls fail. To run them: %s, or set async_rollout: false.",
                           call.name, SIGNAL_FIX)
        result = ToolResult(error_text(f"tool '{call.name}' uses `signal`, which works only on the main thread, and "
                                       f"this rollout runs off it: {SIGNAL_FIX}, or set async_rollout: false"), False)
    return result


def _on_main(fn: Callable, call: ToolCall, timeout: float, loop) -> ToolResult:
    """`call` run on the main thread, interrupted after `timeout` seconds: a timer thread sends the main thread
    WATCHDOG, whose handler raises _Overtime there (a blocking system call is interrupted too)."""
    if WATCHDOG is None:  # no real-time signals (not Linux): unbounded
        return _call(fn, call, loop)
    if signal.getsignal(WATCHDOG) is not _on_watchdog:  # kept once set: a late WATCHDOG finds it, disarmed
        signal.signal(WATCHDOG, _on_watchdog)
    timer = threading.Timer(timeout, signal.pthread_kill, (threading.main_thread().ident, WATCHDOG))
    timer.daemon = True
    try:
        try:
            _ARMED.set()
            timer.start()
            return _call(fn, call, loop)
        finally:
            _ARMED.clear()
            timer.cancel()
    except _Overtime:
        _ARMED.clear()
        timer.cancel()
        return timed_out(call, timeout)


@dataclass
class Toolset:
    """The tools one episode may call: `functions` by the name the model calls, `template_tools` their schemas
    for the chat template (Protocol.template_tools). Without an `environment` the tools are stateless and calls
    run concurrently; an environment's methods share its state, so its calls run one at a time, in order
    (environments.py), its async ones on the instance's own event loop (`loop`). `turn_rewards`: per tool turn run,
    the step rewards its own calls appended.

    A call that times out is waited for before anything else touches the instance (the next call, the rewards,
    a reset for another episode: `settle`, or `settle_all` for a batch at once), so calls never overlap, and what it
    appends late is credited to no turn: the model was told that it failed. One still running `timeout` seconds
    after that marks the instance `stuck` (logged with its class, method and row), never waited for again: the
    episode's further calls fail unrun, its rewards are None, and the pool makes a new instance instead of reusing
    it."""

    functions: dict[str, Callable]
    template_tools: list[dict] | None = None
    environment: object = None
    turn_rewards: list[list[float]] = field(default_factory=list)
    label: str = ""  # the class and the row, for the errors a user reads (EnvironmentPool.start)
    running: threading.Thread | None = None  # a timed-out call of the environment that may still run
    running_call: str = ""  # its method, for the log
    stuck: bool = False
    failures: list[str] = field(default_factory=list)  # the calls that raised: class.method (row): the error
    timeout: float = 10.0  # the last call's bound, and the grace `settle` gives a timed-out call
    loop: asyncio.AbstractEventLoop | None = None  # the environment's own event loop (None: the shared one)
    carry: list[float] = field(default_factory=list)  # scores of a turn not answered yet (a continuation's)

    def run(self, calls: list[ToolCall], timeout: float, max_workers: int) -> list[ToolResult]:
        """One model turn's calls; for a user_turns.UserTurn (no call), the environment's reply as the user."""
        if self.environment is None:
            return run_tool_calls(self.functions, calls, timeout, max_workers)
        self.timeout = timeout
        if isinstance(calls, UserTurn):
            return [self.respond(calls.messages, timeout)]
        earned, self.carry = self.carry, []
        results = [self._run_one(call, timeout, earned) for call in calls]
        self.turn_rewards.append(earned)
        return results

    def respond(self, messages: list[dict], timeout: float) -> ToolResult:
        """The environment's `respond(messages)`, as a call is run (after any timed-out call has ended, on a thread,
        within `timeout`): a ToolResult whose output is the Reply (or None), or the error."""
        if not self.settle(timeout):
            return ToolResult(f"not run: an earlier call of this episode is still running ({self.label})", False)
        outcome = self.bounded("respond", lambda: self.environment.respond(messages), timeout)
        if outcome is None:
            return ToolResult(f"timed out after {timeout:g}s ({self.label})", False, timeout)
        ok, value = outcome
        if not ok and _refused_signal(value) and not inspect.iscoroutinefunction(self.environment.respond):
            ok, value = self._respond_on_main(messages, timeout)  # it uses `signal` (math_verify's timeouts)
        try:
            return ToolResult(as_reply(value, type(self.environment).__name__), True) if ok else \
                ToolResult(f"raised {type(value).__name__}: {value} ({self.label})", False)
        except ValueError as e:  # a reply of the wrong type: a bug in the class, which the log names
            raise ValueError(f"{e} ({self.label})") from None

    def _run_one(self, call: ToolCall, timeout: float, earned: list) -> ToolResult:
        """One call on the environment, after any timed-out one has ended; what it added to step_rewards while
        it ran goes to `earned`, unless it timed out."""
        if not self.settle(timeout):
            return ToolResult(error_text(f"tool '{call.name}' was not run: an earlier call of this episode timed "
                                         "out and is still running"), False)
        before = self.step_rewards(), list(self.step_rewards())  # the object, and what it held
        thread, slot = start_call(self.functions, call, self.loop)
        if thread is not None:
            join(thread, timeout)
        if thread is not None and thread.is_alive():
            self.running, self.running_call = thread, call.name  # timed out: nothing it adds from now on is credited
            return timed_out(call, timeout)
        result = slot[0]
        ran = thread is not None or result.main_thread
        if result.main_thread:  # a method that uses `signal`
            result = run_on_main(self.functions, call, timeout, self.loop)
        earned.extend(self.added_step_rewards(before))  # its call has ended: every reward it added is in
        if not result.ok and ran:
            method = f"{type(self.environment).__name__}.{call.name}"
            self.failures.append(f"{method} ({self.label}): {result.output}")
            if method not in _LOGGED_FAILURES:  # once per method: a policy's bad calls are many
                _LOGGED_FAILURES.add(method)
                logger.warning("Environment tool failed (the first failure of %s; the model sees each): %s", method,
                               self.failures[-1])
        return result

    def settle(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: the last call's timeout) for a timed-out call still running; False
        (and `stuck`) if it still is. A stuck call is not waited for again."""
        return settle_all([self], self.timeout if timeout is None else timeout)

    def bounded(self, method: str, call: Callable[[], object], timeout: float) -> tuple[bool, object] | None:
        """`call()`, a call of the environment's `method` that is not a tool (respond, get_reward, end_episode), on a
        daemon thread (awaited on the instance's own loop when async), waited for `timeout` seconds: (True, its value)
        or (False, its exception); None when it still runs then, which becomes `running` (a later `settle` waits for
        it; the caller marks the instance `stuck` where nothing will)."""
        thread, out = in_thread(lambda: run_async(call(), self.loop), f"{method}-{type(self.environment).__name__}")
        join(thread, timeout)
        if thread.is_alive():
            self.running, self.running_call = thread, method
            return None
        return out[0]

    def _respond_on_main(self, messages: list[dict], timeout: float) -> tuple[bool, object]:
        """A sync `respond` that uses `signal`, run as a tool that does (run_on_main: on the main thread, bounded by
        `timeout`): (True, its reply) or (False, the error)."""
        replies: list = []
        job = lambda messages: replies.append(self.environment.respond(messages)) or ""  # noqa: E731
        result = run_on_main({"respond": job}, ToolCall("respond", {"messages": messages}), timeout, self.loop)
        return (True, replies[0]) if result.ok and replies else (False, RuntimeError(result.output))

    def step_rewards(self) -> list | tuple:
        """The environment's step_rewards as it is now (NO_STEP_REWARDS, one object, when it has none: a call then
        added nothing, and replaced no list); a wrong type fails naming it."""
        steps = getattr(self.environment, "step_rewards", None)
        if steps is None:
            return NO_STEP_REWARDS
        if not isinstance(steps, STEP_REWARD_TYPES):
            raise TypeError(f"{type(self.environment).__name__}.step_rewards is a {type(steps).__name__} "
                            f"({self.label or 'during an episode'}); make it a list of numbers (one appended per "
                            "tool step), reset to [] in `reset`.")
        return steps

    def added_step_rewards(self, before: tuple) -> list:
        """What one call added to step_rewards, `before` being (the object, its contents) when the call started: the
        new tail when it grew (appended to, or replaced by a longer one that starts the same, as a tuple is); the whole
        new list when the method replaced it (`self.step_rewards = [r]` at every step: that step's rewards)."""
        obj, held = before
        current = self.step_rewards()
        now = list(current)
        if current is obj or (len(now) > len(held) and now[: len(held)] == held):
            return now[len(held):]
        method = type(self.environment).__name__
        if method not in _REPLACED:
            _REPLACED.add(method)
            logger.warning("%s replaces its step_rewards list at a step instead of appending to it: each new list is "
                           "read as that step's rewards (append instead, `self.step_rewards.append(r)`, to say so "
                           "plainly).", method)
        return now


def settle_all(toolsets: list[Toolset], grace: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait for the timed-out calls still running in `toolsets`, all together, within one `grace` (seconds) for the
    whole batch; each still running then makes its Toolset `stuck`, logged once with its class, method and row.
    Stuck ones are not waited for again. True when none of them is stuck. `clock`: what the deadline reads."""
    waiting = [t for t in toolsets if t.running is not None and not t.stuck]
    deadline = clock() + grace
    for toolset in waiting:
        join(toolset.running, max(0.0, deadline - clock()), clock)
    newly = [t for t in waiting if t.running.is_alive()]
    for toolset in waiting:
        if toolset in newly:
            toolset.stuck = True
        else:
            toolset.running = None
    if newly:
        logger.warning("%d environment call(s) still running %gs after they timed out; their episodes get no "
                       "reward from them and their instances are not reused: %s", len(newly), grace,
                       "; ".join(f"{type(t.environment).__name__}.{t.running_call} ({t.label})" for t in newly))
    return not any(t.stuck for t in toolsets)


def run_turns(turns: list[tuple[Toolset, list[ToolCall]]], timeout: float,
              max_workers: int) -> list[list[ToolResult]]:
    """The results of several episodes' turns, each turn's calls run by its Toolset. The turns of one stateless
    toolset run as one batch of concurrent calls; each environment's turn runs on its own thread, beside them."""
    results: list[list[ToolResult] | None] = [None] * len(turns)
    by_toolset: dict[int, list[int]] = {}
    for i, (toolset, _) in enumerate(turns):
        by_toolset.setdefault(id(toolset), []).append(i)
    with MAIN.serving(), concurrent.futures.ThreadPoolExecutor(max(1, min(max_workers, len(turns))),
                                                               thread_name_prefix="env-turns") as pool:
        stateful = {pool.submit(turns[i][0].run, turns[i][1], timeout, max_workers): i
                    for i, (toolset, _) in enumerate(turns) if toolset.environment is not None}
        for indices in by_toolset.values():
            toolset = turns[indices[0]][0]
            if toolset.environment is None:
                flat = toolset.run([c for i in indices for c in turns[i][1]], timeout, max_workers)
                for i in indices:
                    results[i], flat = flat[: len(turns[i][1])], flat[len(turns[i][1]):]
        while not all(future.done() for future in stateful):  # running the calls they hand to the main thread
            MAIN.wait(stateful, 1.0)
        for future, i in stateful.items():
            results[i] = future.result()
    return results
