"""AgentEnv: the trainer's env when an agent program is the rollout (`agent`, `agent_command`). It has the built-in
env's interface (`rollout`, `release`; everything else is the wrapped MultiTurnToolEnv's), starts one agent per
episode against its own address on the endpoint (endpoint.py), and gives each call its sample: a server's
`submit` as calls come, or, in process, one batched `generate` once every running agent waits on a call (or
`agent_batch_wait` after the first call waiting). An agent's result is scored by `agent_reward` (R_O) and, with
`agent_call_scores`, its per-call scores by `agent_call_scores` (R_T, per turn); the run's reward functions score the
recorded conversation as always."""

import asyncio
import concurrent.futures
import inspect
import json
import logging
import os
import subprocess
import threading
import time

from mt_grpo.agents.endpoint import Endpoint, log_once, settle
from mt_grpo.agents.routes import make_app
from mt_grpo.base.registry import resolve
from mt_grpo.base.runtime import stop_point
from mt_grpo.rewards import per_tool_turn
from mt_grpo.rollout.episodes import Episode, check_tokenization, run_length

logger = logging.getLogger("mt_grpo")


def load_agent(value):
    """The `agent` field or keyword: a dotted path `module:function`, or a function."""
    if isinstance(value, str):
        return resolve(value, {}, "agent")
    if not callable(value):
        raise ValueError(f"`agent` is a {type(value).__name__}; give a function of (row, client) or (row, base_url, "
                         "api_key), or its dotted path `module:function`.")
    return value


class AgentEnv:
    """MultiTurnToolEnv's interface, an agent program's episodes (module docstring)."""

    def __init__(self, env, *, agent=None, command: str | None = None, timeout: float = 300.0,
                 host: str = "127.0.0.1", port: int = 0, honour: str = "run", batch_wait: float = 0.05,
                 max_prompt_length: int | None = None):
        self.env, self.agent, self.command = env, agent, command
        self.timeout, self.batch_wait = timeout, batch_wait
        self.endpoint = Endpoint(env, host=host, port=port, max_prompt_length=max_prompt_length, honour=honour)
        self.endpoint_started = False
        self.loop: asyncio.AbstractEventLoop | None = None  # where async agents run, the whole run long
        self.results: dict[int, dict] = {}  # id(ep.messages) -> the agent's result ({reward, call_scores})
        self.pending: list[tuple] = []  # (ids, max_tokens, future, episode index, first call) of the calls waiting
        self.ready = threading.Condition()
        self.live = 0  # agents running
        self.failure: BaseException | None = None  # the backend's error, which stops the run
        agent_reward, agent_call_scores = self.reward_functions()
        self.agent_reward, self.agent_call_scores = agent_reward, agent_call_scores

    def __getattr__(self, name):  # everything but the rollout is the built-in env's (rendering, protocol, tools)
        return getattr(self.__dict__["env"], name)

    # -- rewards: the agent's result ------------------------------------------------------------------
    def reward_functions(self):
        results = self.results

        def agent_reward(prompts, completions, **kwargs) -> list[float | None]:
            """The reward each episode's agent returned (None where it returned none)."""
            return [results.get(id(c), {}).get("reward") for c in completions]

        @per_tool_turn
        def agent_call_scores(prompts, completions, **kwargs) -> list[list[float | None]]:
            """The agent's score of each model call (`call_scores`), its turn's R_T."""
            out = []
            for c in completions:
                turns = sum(m["role"] == "assistant" for m in c)
                scores = list(results.get(id(c), {}).get("call_scores") or [])[:turns]
                out.append(scores + [None] * (turns - len(scores)))
            return out

        return agent_reward, agent_call_scores

    # -- the rollout ---------------------------------------------------------------------------------
    def rollout(self, prompts: list, backend, params=None, progress: bool = False,
                rows: list[dict] | None = None) -> list[Episode]:
        """One episode per row (`prompts`: the rows' prompts, for a row without one): each its agent, run to its end
        or to agent_timeout; episodes in the order of the rows."""
        accelerator = getattr(backend, "accelerator", None)
        if not backend.can_submit and accelerator is not None and accelerator.num_processes > 1:
            raise ValueError("An agent run on several processes needs `generation_backend: vllm_server` (in-process "
                             "generation runs in lock-step rounds across processes, which agents' calls do not).")
        if not self.endpoint_started:
            self.endpoint.start(make_app(self.endpoint))
            self.endpoint_started = True
        self.endpoint.sampling = params or getattr(backend, "params", None)
        self.endpoint.sample = self.submitter(backend, params) if backend.can_submit else self.enqueue
        rows = rows if rows is not None else [{"prompt": p} for p in prompts]
        sessions = [self.endpoint.open(dict(row), self.timeout) for row in rows]
        done: dict[str, object] = {}  # session id -> the agent's result, or the exception it raised
        finished = threading.Event()
        with self.ready:
            self.live = len(sessions)
        if self.agent is not None and inspect.iscoroutinefunction(self.agent) and self.loop is None:
            # one loop for the run, not one a rollout: a client a library keeps between runs (the Agents SDK's
            # shared httpx client) holds connections of the loop it was first used on, dead on a new one
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="agents", daemon=True).start()
        loop = self.loop
        running = {s.id: self.start(s, loop, done, finished) for s in sessions}
        try:
            self.serve(sessions, backend, params, done, running)
        finally:
            for s in sessions:
                if not s.ended:
                    self.endpoint.end(s, "agent_timeout")
                self.stop(running[s.id])
        episodes = [self.episode(s, done.get(s.id)) for s in sessions]
        for s in sessions:
            self.endpoint.forget(s)
        # the check compares the last sample with a render of the recorded messages: not where the agent rewrote them
        called = [ep for ep in episodes if ep.stop_reason != "no_call" and not any(
            ep.agent_stats.get(f"new_samples/{why}") for why in ("rewrite", "tools"))]
        check_tokenization(self.env, [ep.prompt_messages for ep in called], called, self.env.tokenization_check)
        return episodes

    def serve(self, sessions, backend, params, done: dict, running: dict) -> None:
        """Until every agent has returned or timed out: in-process generation of the waiting calls (batched), and
        the deadlines."""
        first_wait = None
        while True:
            stop_point()  # SIGTERM: the step is dropped, the agents ended (rollout's finally)
            if self.failure is not None:
                failure, self.failure = self.failure, None
                raise failure
            now = time.monotonic()
            for s in sessions:
                if not s.ended and s.id not in done and now > s.deadline:
                    self.endpoint.end(s, "agent_timeout")
                    self.stop(running[s.id])
                    with self.ready:
                        self.live -= 1
                        self.ready.notify_all()
            if all(s.ended or s.id in done for s in sessions):
                with self.ready:
                    if not self.pending:
                        return
            if backend.can_submit:
                with self.ready:
                    self.ready.wait(0.1)
                continue
            with self.ready:
                if not self.pending:
                    first_wait = None
                    self.ready.wait(0.1)
                    continue
                first_wait = first_wait or time.monotonic()
                if len(self.pending) < self.live and time.monotonic() - first_wait < self.batch_wait:
                    self.ready.wait(min(0.1, self.batch_wait))  # a deadline is checked every 0.1 s
                    continue
                batch, self.pending, first_wait = self.pending, [], None
            # in the episodes' order; first calls of a group, identical prompts, as one prompt with n samples (as the
            # built-in loop asks); a timed-out episode's call was answered already
            live = sorted((e for e in batch if not e[2].done()), key=lambda e: e[3])
            if not live:
                continue
            seqs, budgets = [e[0] for e in live], [e[1] for e in live]
            n = run_length(seqs) if len(set(budgets)) == 1 and all(e[4] for e in live) else 1
            samples = backend.generate(seqs[::n], budgets[::n], n, params)
            for e, sample in zip(live, samples):
                settle(e[2], sample)

    def enqueue(self, ids: list[int], max_tokens: int, order: int = 0,
                first: bool = False) -> concurrent.futures.Future:
        """In process: the call waits for the next batched generate (serve)."""
        future = concurrent.futures.Future()
        with self.ready:
            self.pending.append((ids, max_tokens, future, order, first))
            self.ready.notify_all()
        return future

    def submitter(self, backend, params):
        def submit(ids: list[int], max_tokens: int, order: int = 0, first: bool = False) -> concurrent.futures.Future:
            mine = concurrent.futures.Future()
            def answered(f):
                if f.exception() is not None:
                    self.failure = f.exception()  # the run stops (serve), as the built-in loop's would
                settle(mine, None if f.exception() else f.result()[0], f.exception())

            backend.submit([ids], max_tokens, 1, params).add_done_callback(answered)
            return mine

        return submit

    # -- the agents ----------------------------------------------------------------------------------
    def start(self, s, loop, done: dict, finished: threading.Event):
        """Start the agent of session `s`; what `stop` ends."""
        base_url, key = self.endpoint.base_url(s), s.key

        def finish(result=None, error: BaseException | None = None):
            done[s.id] = error if error is not None else result
            with self.ready:
                self.live -= 0 if s.ended else 1
                self.ready.notify_all()
            if not s.ended:
                self.endpoint.end(s, "agent_error" if error is not None else "agent_done")

        if self.command is not None:
            env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key,
                   "MT_GRPO_ROW": json.dumps(s.row, default=str)}
            proc = subprocess.Popen(self.command, shell=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)

            def wait():
                out, err = proc.communicate()
                if proc.returncode != 0:
                    finish(error=RuntimeError(f"agent_command exited {proc.returncode}: {err.strip()[-500:]}"))
                    return
                last = out.strip().splitlines()[-1] if out.strip() else ""
                try:
                    finish(json.loads(last) if last else None)
                except json.JSONDecodeError:
                    finish(None)

            threading.Thread(target=wait, daemon=True).start()
            return proc
        call = self.call(s, base_url, key)
        if loop is not None:
            future = asyncio.run_coroutine_threadsafe(call(), loop)
            future.add_done_callback(lambda f: finish(error=f.exception()) if not f.cancelled() and f.exception()
                                     else finish(None if f.cancelled() else f.result()))
            return future

        def run():
            try:
                result = call()
            except BaseException as e:  # noqa: BLE001 - whatever the agent raises ends its episode, not the run
                finish(error=e)
            else:
                finish(result)

        thread = threading.Thread(target=run, name=f"agent-{s.id}", daemon=True)
        thread.start()
        return thread

    def call(self, s, base_url: str, key: str):
        """The agent's call for session `s`: with (row, base_url, api_key) where its signature names them, else with
        (row, client), an openai client (async for an async agent) of the episode's address."""
        params = inspect.signature(self.agent).parameters
        if {"base_url", "api_key"} <= set(params):
            return lambda: self.agent(s.row, base_url=base_url, api_key=key)
        import openai

        if inspect.iscoroutinefunction(self.agent):
            async def run():
                client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=self.timeout)
                try:
                    return await self.agent(s.row, client)
                finally:  # its connections closed on the loop that opened them
                    await client.close()

            return run

        def run():
            with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=self.timeout) as client:
                return self.agent(s.row, client)

        return run

    @staticmethod
    def stop(handle) -> None:
        """End an agent that has not returned: a process is killed, an async one cancelled; a thread cannot be, and
        its calls are refused (409) from now on."""
        if isinstance(handle, subprocess.Popen) and handle.poll() is None:
            import signal

            try:
                os.killpg(handle.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif isinstance(handle, concurrent.futures.Future):
            handle.cancel()

    def episode(self, s, result) -> Episode:
        """The session's episode, with its stop reason and its agent's result (for agent_reward)."""
        ep = s.ep if s.ep is not None else self.silent_episode(s.row)
        ep.agent_stats = dict(s.stats)
        if isinstance(result, BaseException):
            cause = f"{type(result).__name__}: {str(result).splitlines()[0] if str(result) else ''}"
            log_once("agent_error:" + type(result).__name__, "An agent raised %s; its episode ends agent_error (its "
                     "calls are kept). Logged once per kind of error.", cause)
            ep.stop_reason = "agent_error" if s.ep is not None else "no_call"
            result = None
        elif s.ended == "agent_timeout":
            ep.stop_reason = "agent_timeout" if s.ep is not None else "no_call"
            result = None
        elif s.ep is not None:
            ep.stop_reason = s.last_stop or "agent_done"
        self.results[id(ep.messages)] = agent_result(result)
        ep.agent_ended = s.ended
        if s.ep is None:
            log_once("no_call", "An agent made no model call: its episode has no model tokens (no gradient; counted "
                     "in agent/no_call_ratio).")
        return ep

    def silent_episode(self, row: dict) -> Episode:
        """The episode of an agent that made no model call: the row's prompt as the built-in loop renders it (so that
        a batch of such episodes still has tokens to forward), no completion, `no_call`."""
        prompt = row.get("prompt")
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
            return Episode([], stop_reason="no_call")
        return Episode(self.env.render_ids(prompt, True, self.env.toolset), toolset=self.env.toolset,
                       prompt_messages=prompt, stop_reason="no_call")

    def release(self, episodes: list[Episode]) -> None:
        for ep in episodes:
            self.results.pop(id(ep.messages), None)
        self.env.release(episodes)


def agent_result(value) -> dict:
    """An agent's return value as {reward, call_scores}: None, a number, or a dict of those keys."""
    if value is None:
        return {}
    if not isinstance(value, (int, float, dict)):  # a bool is a number: `return answer in text` is 1.0 or 0.0
        raise ValueError(f"An agent returned {type(value).__name__} {value!r:.80}: return the episode's reward (a "
                         "number), {'reward': ..., 'call_scores': [...]}, or None.")
    if isinstance(value, dict):
        unknown = set(value) - {"reward", "call_scores"}
        if unknown:
            raise ValueError(f"An agent returned a dict with keys {sorted(unknown)}: only `reward` and "
                             "`call_scores` are read.")
        return value
    return {"reward": float(value)}
