"""The run's threads: the shared event loop of async tools and MCP sessions, an instance's own loop, bounded waits on
daemon threads (`in_thread`, `join`), and the stop a SIGTERM asks for (STOP, StopRequested, `stop_point`), which every
wait below checks so that no wait on user code delays it (run.reporting.GracefulStop sets it)."""

import asyncio
import inspect
import threading
import time
from typing import Callable


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
