"""Running tool calls: each on a daemon thread bounded by `tool_timeout` (`run_tool_calls`, `start_call`), what a
tool returned as the tool message's content (`tool_output`, `clean_text`, `cut_tool_output`), and the main thread's
runner for sync tools that use `signal` (MAIN, `run_on_main`, `signal_scope`)."""

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from mt_grpo.base.protocol import (ToolCall, content_text, error_text, holds_images, is_image_block, is_text_block,
                                   json_text)
from mt_grpo.base.runtime import join, run_async, stop_point
from mt_grpo.engine.vision import image_content

logger = logging.getLogger("mt_grpo")


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
        cut = cut_tool_output(shown, tokenizer, max_tokens)  # a list with images keeps them, its text cut
        return text if cut is shown else [*(p for p in text if is_image_block(p)), {"type": "text", "text": cut}] \
            if holds_images(text) else cut
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
    # A failure TRL's tool loop has (the tool raised, its arguments did not fit, no tool has the name): the message
    # TRL shows as `str({"error": message})` (Protocol.tool_reply); "" for a result or a failure TRL never has
    trl_error: str = ""


def tool_output(value, source: str) -> tuple[str | list, float | None]:
    """(the tool message's content, the step reward) of what a tool returned:
        str                   the text (clean_text)
        PIL image             an image block `[{"type": "image", "image": ...}]` (engine/vision.py); a list of blocks
                              with images keeps them where they are, each text block cleaned
        list                  the list, as TRL passes it on (content blocks `[{"type": "text", "text": ...}]`, or
                              any list): the rewards see the list, the model its text (protocol.content_text:
                              the blocks' texts; another list's `str()`, as a template renders it under TRL)
        (output, number)      verl's function-tool pair: `output` as here, and the number as the call's step
                              reward (the tool message's `reward`, which the `tool_rewards` turn reward reads)
        dict, number, bool,   `str()`, as TRL's tool loop shows it (`{'city': 'Morvane'}`, `True`, `None`), so that
        None, other tuples    a TRL script's prompts are TRL's byte for byte"""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float)) \
            and not isinstance(value[1], bool):
        if source not in _REWARDED:
            _REWARDED.add(source)
            logger.info("%s returns (output, reward): the reward is its tool turn's step reward, which the `tool_rewards`"
                        " turn reward reads (list it in turn_reward_funcs).", source)
        return tool_output(value[0], source)[0], float(value[1])
    value = image_content(value, source)  # a PIL image, or blocks with images: kept where they are (engine/vision.py)
    if holds_images(value):  # each text block cleaned, the images kept
        return [dict(p, text=clean_text(p["text"], source)) if is_text_block(p) else p for p in value], None
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
    process alive at exit. Tools get parsed JSON arguments only; malformed calls are not run. `max_workers` None:
    all at once."""
    results: list[ToolResult] = [ToolResult("", False)] * len(calls)
    max_workers = max_workers or max(1, len(calls))
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
        return None, [ToolResult(error_text(f"unknown tool '{call.name}'; available tools: {sorted(tools)}"), False,
                                 trl_error=f"Tool {call.name} not found.")]
    if function_of(tools[call.name]) in SIGNAL_TOOLS:
        return None, [ToolResult("", False, main_thread=True)]
    return _threaded(tools[call.name], call, loop)


def _threaded(fn: Callable, call: ToolCall, loop) -> tuple[threading.Thread, list[ToolResult]]:
    slot: list[ToolResult] = []
    thread = threading.Thread(target=lambda: slot.append(_call(fn, call, loop)), daemon=True, name=f"tool-{call.name}")
    thread.start()
    return thread, slot


def _call(fn: Callable, call: ToolCall, loop: asyncio.AbstractEventLoop | None) -> ToolResult:
    """`call` run here, on this thread; its failure as the `Error: ...` the model sees, with TRL's text of it
    (`trl_error`: str(e)). A sync tool refused `signal` off the main thread is not failed: its result says to run it
    on the main thread. Arguments that do not fit the signature are called all the same, as TRL calls them: Python
    refuses them before the tool's first line, and TRL shows Python's TypeError."""
    begun = time.monotonic()
    try:
        _signature(fn).bind(**call.arguments)  # the arguments against the signature, so that a TypeError the
        misfit = ""  # tool itself raises is reported as raised, not as the model's bad arguments
    except TypeError as e:
        misfit = str(e)
    try:
        with signal_scope(f"tool '{call.name}'", function_of(fn)):
            output = run_async(fn(**call.arguments), loop)  # an async tool: its environment's loop, or the shared one
        content, reward = tool_output(output, f"tool '{call.name}'")
        return ToolResult(content, True, time.monotonic() - begun, reward)
    except Exception as e:  # the model sees the error and the turn reward counts a failure
        if signal_refused(e) and threading.current_thread() is not threading.main_thread():
            if inspect.iscoroutinefunction(function_of(fn)):  # its loop's thread is never the main one
                return ToolResult(error_text(f"tool '{call.name}' uses `signal`, which works only on the main "
                                             f"thread, and async tools run on an event loop's: {SIGNAL_FIX}"), False)
            SIGNAL_TOOLS.add(function_of(fn))  # `signal` bound by name before guard_signals: this call runs again
            logger.warning("Tool '%s' uses `signal` (%s), which works only on the main thread, through a name bound "
                           "before mt-grpo guarded `signal` (`from signal import ...` at import): this call is run "
                           "again there, and so are its calls from now on, one at a time, after the concurrent ones, "
                           "each bounded by tool_timeout (docs/guide.md, 'Adding a tool'). To keep them concurrent: "
                           "%s", call.name, e, SIGNAL_FIX)
            return ToolResult("", False, time.monotonic() - begun, main_thread=True)
        ours = f"bad arguments for tool '{call.name}': {misfit}" if misfit else \
            f"tool '{call.name}' raised {type(e).__name__}: {e}"
        return ToolResult(error_text(ours), False, time.monotonic() - begun, trl_error=str(e))


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


# A sync tool that sets a signal handler or an alarm (TRL's grpo_agent.py tool times its query with SIGALRM;
# math_verify's parse and verify do by default) is refused on any thread but the main one: "signal only works in
# main thread". So that no call runs twice (a tool that changes state before it arms its alarm would apply that
# twice), a call of user code off the main thread runs in a `signal_scope`, where `signal.signal`, `signal.alarm`
# and `signal.setitimer` are skipped instead of refused (an alarm armed there would fire on the main thread, whose
# default for SIGALRM ends the process), and noted: that call runs once, to its end, bounded by tool_timeout as
# every call is. From then on a sync tool's calls run on the main thread, where its alarm works, one at a time, each
# bounded by tool_timeout through WATCHDOG (a real-time signal, so that the tool's own SIGALRM stays its own). A
# thread that is not the main one hands its call to the main thread (MAIN), which runs it where it waits for the
# tools: in run_turns (rounds) and in the per-episode scheduler's loop. A rollout beside training (async_rollout) has
# no such wait, nor does an event loop's thread (an async tool, an async `respond`): there the calls keep running in
# a scope, their alarms skipped. `signal` bound before the guards were set (`from signal import alarm` at import)
# is not seen: its refusal moves the tool to the main thread after its first call has failed, which is run again.
SIGNAL_REFUSED = "signal only works in main thread"
SIGNAL_FIX = ("drop the signal from the code, as tool_timeout bounds each call (math_verify: "
              "`parse(..., parsing_timeout=None)`, `verify(..., timeout_seconds=None)`)")
WATCHDOG = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
SIGNAL_TOOLS: set = set()  # the sync functions (tools, `respond`) whose calls run on the main thread
_OFF_MAIN: set[str] = set()  # the tools whose call found no main thread to run on (logged once)
_ARMED = threading.Event()  # a call runs on the main thread under WATCHDOG


@dataclass
class SignalUse:
    """What a `signal_scope` saw: `used` once its code called `signal` off the main thread (skipped)."""

    source: str  # what the log names: "tool 'check'", "Quiz.respond"
    function: Callable | None = None  # the tool's function, for the tools that run on the main thread from now on
    used: bool = False


_SCOPE: contextvars.ContextVar[SignalUse | None] = contextvars.ContextVar("mt_grpo_signal_scope", default=None)
_SKIPPED_LOGGED: set[str] = set()


def _skipped_off_main(original: Callable, skipped: Callable) -> Callable:
    """`original` (signal.signal, .alarm, .setitimer) as it is, but inside a signal_scope off the main thread, where it
    does `skipped` and notes the scope's use."""

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        scope = _SCOPE.get()
        if scope is None or threading.current_thread() is threading.main_thread():
            return original(*args, **kwargs)
        scope.used = True
        return skipped(*args, **kwargs)

    guarded.mt_grpo_original = original
    return guarded


def guard_signals() -> None:
    """Set the guards on `signal`'s functions (once; outside a signal_scope they call the originals)."""
    if hasattr(signal.signal, "mt_grpo_original"):
        return
    getsignal = signal.getsignal
    signal.signal = _skipped_off_main(signal.signal, lambda signum, handler: getsignal(signum))
    signal.alarm = _skipped_off_main(signal.alarm, lambda seconds: 0)
    if hasattr(signal, "setitimer"):
        signal.setitimer = _skipped_off_main(signal.setitimer, lambda which, seconds, interval=0.0: (0.0, 0.0))


@contextlib.contextmanager
def signal_scope(source: str, function: Callable | None = None):
    """The scope of one call of user code (`source`): off the main thread its `signal` calls are skipped, not refused,
    and the call runs once. An async call started here takes the scope to its loop (asyncio copies the context).
    After it, a sync tool that used `signal` (`function`) runs on the main thread; the first use is logged."""
    guard_signals()
    scope = SignalUse(source, function)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
        if scope.used:
            _note_signal_use(scope)


def _note_signal_use(scope: SignalUse) -> None:
    to_main = scope.function is not None and not inspect.iscoroutinefunction(scope.function)
    if to_main:
        SIGNAL_TOOLS.add(scope.function)
    if scope.source in _SKIPPED_LOGGED:
        return
    _SKIPPED_LOGGED.add(scope.source)
    where = ("from now on its calls run on the main thread, where its alarm works, one at a time, after the "
             "concurrent ones, each bounded by tool_timeout" if to_main else
             "its calls keep running off the main thread (an event loop's, a worker's for a method that is no tool "
             "nor respond, or a rollout beside training), so its alarms are skipped at every call, each bounded by "
             "tool_timeout")
    logger.warning("%s uses `signal`, which works only on the main thread: its first call ran once, here, with its "
                   "alarm skipped (bounded by tool_timeout); %s (docs/guide.md, 'Adding a tool'). To keep it "
                   "concurrent with its own timeout gone: %s", scope.source, where, SIGNAL_FIX)


class _Overtime(BaseException):
    """Raised in the main thread by WATCHDOG's handler: a BaseException, so that a tool's `except Exception` does
    not take it for its own error and carry on."""


def function_of(fn: Callable) -> Callable:
    """The function behind `fn` (an environment's bound method: its class's function, the same for every instance)."""
    return getattr(fn, "__func__", fn)


def signal_refused(error: BaseException | None) -> bool:
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
    if result is None:  # no main thread waits for the tools (async_rollout): run here, its alarms skipped
        if call.name not in _OFF_MAIN:
            _OFF_MAIN.add(call.name)
            logger.warning("Tool '%s' uses `signal`, which works only on the main thread, and this rollout runs off "
                           "it (async_rollout): its calls run on worker threads with their alarms skipped, each "
                           "bounded by tool_timeout. For its own timeouts, set async_rollout: false.", call.name)
        thread, slot = _threaded(tools[call.name], call, loop)
        result = finish_call(call, thread, slot, timeout, timeout)
        if result.main_thread:  # refused all the same (`signal` bound by name before the guards)
            result = ToolResult(error_text(f"tool '{call.name}' uses `signal`, which works only on the main thread, "
                                           f"and this rollout runs off it: {SIGNAL_FIX}, or set async_rollout: "
                                           "false"), False)
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
