"""An episode's tools (`Toolset`): the stateless tools' calls, run concurrently, or an environment instance's, run one
at a time on its own loop, with the step rewards each call added and the environment's replies as the user;
`settle_all` and `run_turns`, which run a round's turns of many episodes."""

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from mt_grpo.base.protocol import ToolCall, error_text
from mt_grpo.base.runtime import ContractBroken, in_thread, join, run_async
from mt_grpo.rollout.tool_calls import (MAIN, SIGNAL_TOOLS, ToolResult, function_of, run_on_main, run_tool_calls,
                                        signal_refused, signal_scope, start_call, timed_out)
from mt_grpo.rollout.user_turns import UserTurn, as_reply

logger = logging.getLogger("mt_grpo")


STEP_REWARD_TYPES = (list, tuple)  # a list appended to, or a tuple replaced by a longer one
NO_STEP_REWARDS = ()  # what Toolset.step_rewards gives for an environment without them
_LOGGED_FAILURES: set[str] = set()  # the environment methods whose first failure was logged
_REPLACED: set[str] = set()  # the environment classes that replace their step_rewards list (logged once)


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
        respond = self.environment.respond
        if function_of(respond) in SIGNAL_TOOLS:  # a sync respond that uses `signal`: on the main thread
            ok, value = self._respond_on_main(messages, timeout)
        else:
            outcome = self.bounded("respond", lambda: respond(messages), timeout, to_main=respond)
            if outcome is None:
                return ToolResult(f"timed out after {timeout:g}s ({self.label})", False, timeout)
            ok, value = outcome
            if not ok and signal_refused(value) and not inspect.iscoroutinefunction(respond):
                SIGNAL_TOOLS.add(function_of(respond))  # `signal` bound by name before the guards:
                ok, value = self._respond_on_main(messages, timeout)  # this call runs again, here
        if not ok and isinstance(value, ContractBroken):  # a bug in the class (a swift step's wrong type): the run stops
            raise ContractBroken(f"{value} ({self.label})") from value
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
        if thread is None and not call.error and call.name not in self.functions:
            self.unknown_tool()
        earned.extend(self.added_step_rewards(before))  # its call has ended: every reward it added is in
        if not result.ok and ran:
            method = f"{type(self.environment).__name__}.{call.name}"
            self.failures.append(f"{method} ({self.label}): {result.output}")
            if method not in _LOGGED_FAILURES:  # once per method: a policy's bad calls are many
                _LOGGED_FAILURES.add(method)
                logger.warning("Environment tool failed (the first failure of %s; the model sees each): %s", method,
                               self.failures[-1])
        return result

    def unknown_tool(self) -> None:
        """A call naming no tool of the episode: the environment's `unknown_tool_reward` (a plain attribute; None or
        absent: nothing, the call scores nothing) appended to its step_rewards, as verl's loop appends 0.0 to
        tool_rewards for a name it has no tool for."""
        value = getattr(self.environment, "unknown_tool_reward", None)
        steps = self.step_rewards()
        if value is not None and isinstance(steps, list):
            steps.append(value)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: the last call's timeout) for a timed-out call still running; False
        (and `stuck`) if it still is. A stuck call is not waited for again."""
        return settle_all([self], self.timeout if timeout is None else timeout)

    def bounded(self, method: str, call: Callable[[], object], timeout: float,
                to_main: Callable | None = None) -> tuple[bool, object] | None:
        """`call()`, a call of the environment's `method` that is not a tool (respond, get_reward, end_episode), on a
        daemon thread (awaited on the instance's own loop when async), waited for `timeout` seconds: (True, its value)
        or (False, its exception); None when it still runs then, which becomes `running` (a later `settle` waits for
        it; the caller marks the instance `stuck` where nothing will). It runs in a signal_scope (its `signal` calls
        skipped, never refused); `to_main`: the method, which runs on the main thread from then on if it used one."""
        name = type(self.environment).__name__

        def scoped():
            with signal_scope(f"{name}.{method}", function_of(to_main)):
                return run_async(call(), self.loop)

        thread, out = in_thread(scoped, f"{method}-{name}")
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
    with MAIN.serving(), concurrent.futures.ThreadPoolExecutor(max(1, min(max_workers or len(turns), len(turns))),
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
