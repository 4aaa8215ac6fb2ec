"""The run's threads: the shared event loop of async tools and MCP sessions, an instance's own loop, bounded waits on
daemon threads (`in_thread`, `join`), a lock whose stuck holder is given up on (`PatientLock`), and the stop a SIGTERM
asks for (STOP, StopRequested, `stop_point`), which every wait below checks so that no wait on user code delays it
(run.reporting.GracefulStop sets it)."""

import asyncio
import contextlib
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
    threading.Thread(target=_serve, args=(loop,), name=f"async-{name}", daemon=True).start()
    return loop


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """Run `loop` until stop_event_loop stops it; then cancel what still waits on it (a second at most) and close it,
    which gives its thread and file descriptors back."""
    loop.run_forever()
    if pending := asyncio.all_tasks(loop):
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
    loop.close()


def stop_event_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Stop an own_event_loop (an instance the pool drops): at once when it is idle, else as soon as the call that
    blocks it returns."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)


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


class PatientLock:
    """A lock for user code that is not thread-safe (a scheduler shared by every episode): one holder at a time, as
    one event loop would run it, but a holder past `patience` seconds is no longer waited for (the next waiter takes
    the lock, and runs beside it), so that a call that never returns stalls only its own episode, never the others'.
    `with lock.held():`; the waits check STOP."""

    def __init__(self, patience: float, clock: Callable[[], float] = time.monotonic):
        self.patience, self.clock = patience, clock
        self._changed = threading.Condition()
        self._holder: tuple[object, float] | None = None  # (whose, since when)

    @contextlib.contextmanager
    def held(self):
        me = object()
        with self._changed:
            while self._holder is not None and (left := self._holder[1] + self.patience - self.clock()) > 0:
                stop_point()
                self._changed.wait(min(left, 0.25))
            self._holder = (me, self.clock())  # free, or its holder given up on
        try:
            yield
        finally:
            with self._changed:
                if self._holder is not None and self._holder[0] is me:  # not taken over since
                    self._holder = None
                    self._changed.notify()


class ContractBroken(ValueError):
    """A user's class returned what its contract does not allow (a swift `step` of the wrong type): a bug in the
    class, which the error names with the field to fix. No bound turns it into one episode's failure: the run stops
    with it, as it does on a `respond` of the wrong type (rollout/toolset.py)."""


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
