"""The per-episode rollout scheduler (`rollout_scheduler: per_episode`, the default with a server that takes requests
one at a time): no round barrier, each conversation takes its next turn as soon as its tool results are back.
MultiTurnToolEnv.rollout calls it; the lock-step rounds an in-process model needs stay in the env (`_rounds`)."""

import concurrent.futures
from typing import Callable

from mt_grpo.rollout.episodes import identical_runs
from mt_grpo.base.runtime import stop_point
from mt_grpo.rollout.tool_calls import MAIN


def run_per_episode(env, episodes: list, backend, params, bar) -> None:
    """No round barrier: each conversation takes its next turn as soon as its tool results are
    back. Conversations that are ready together (same token budget) share a request, up to
    backend.prompts_per_request, while others are in flight; at most backend.max_concurrent_requests
    requests are in flight. A group of identical first prompts is one request with n samples. `env`: the
    MultiTurnToolEnv whose turns are recorded; `bar`: its progress bar."""
    # (episodes, n): first turns; a group is the same ids with the same images (two rows may ask one question of two)
    ready = [(group, len(group)) for group in identical_runs(episodes, key=env.vision.request_key)]
    in_flight: dict[concurrent.futures.Future, tuple] = {}
    # the episodes' tool turns at once (tool_max_workers None: one worker each, made as they are needed)
    tool_pool = concurrent.futures.ThreadPoolExecutor(env.tool_max_workers or max(1, len(episodes)),
                                                      thread_name_prefix="tools")
    try:
        with MAIN.serving():  # a tool that uses `signal` runs on this (the main) thread
            while ready or in_flight:
                stop_point()  # SIGTERM on one process: the step is dropped (reporting.stoppable)
                requests = sum(kind == "generate" for kind, _ in in_flight.values())
                while ready and requests < backend.max_concurrent_requests:
                    batch, ready = next_request(ready, backend.prompts_per_request, env.budget)
                    n = batch[0][1]
                    eps = [ep for group, _ in batch for ep in group[:1 if n > 1 else None]]
                    future = backend.submit([ep.context_ids for ep in eps], env.budget(eps[0]), n, params,
                                            **env.vision.generation_images(eps))  # their images (engine/vision.py)
                    in_flight[future] = ("generate", [ep for group, _ in batch for ep in group])
                    requests += 1
                finished = MAIN.wait(in_flight, 1.0)  # 1 s: a SIGTERM is seen within it
                for future in finished:
                    kind, payload = in_flight.pop(future)
                    if kind == "generate":
                        samples = future.result()
                        if len(samples) != len(payload):
                            raise RuntimeError(f"generation backend returned {len(samples)} samples for "
                                               f"{len(payload)} conversations")
                        for ep, sample in zip(payload, samples):
                            if (calls := env.record_model_turn(ep, sample)) is not None:
                                in_flight[tool_pool.submit(ep.toolset.run, calls, env.tool_timeout,
                                                           env.tool_max_workers)] = ("tools", (ep, calls))
                    else:
                        ep, calls = payload
                        env.record_env_turn(ep, calls, future.result())
                        if not ep.done:
                            ready.append(([ep], 1))
                bar.update(episodes, tool_calls=sum(len(p[1]) for k, p in in_flight.values() if k == "tools"))
    finally:
        tool_pool.shutdown(wait=False)


def next_request(ready: list[tuple[list, int]], per_request: int, budget_of: Callable):
    """The ready work for one request: the first entry and, if it is a single later turn, up to
    per_request - 1 more single turns with the same token budget (a request has one max_tokens)."""
    first, rest = ready[0], ready[1:]
    if first[1] > 1:
        return [first], rest
    budget = budget_of(first[0][0])
    same = [r for r in rest if r[1] == 1 and budget_of(r[0][0]) == budget][: per_request - 1]
    return [first, *same], [r for r in rest if not any(r is t for t in same)]
