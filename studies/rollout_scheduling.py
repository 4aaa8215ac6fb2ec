"""Rollout scheduling with long-tail tools: per-episode scheduling against lock-step rounds.

    bash scripts/setup_vllm.sh && .venv/bin/python studies/rollout_scheduling.py

A real vllm-cpu server (the tiny agent model), 32 prompts x 4 generations, episodes of 1 to 4 turns
(max_env_steps 3), a search tool whose latency is lognormal with median 0.2 s and p99 about 4 s.
The latencies come from one seeded sequence, call by call, so every scheduler sees the same draws;
every run asks the server for the same outputs (same turn budgets, logprobs and token ids). Sampling
is not seeded (one seed for every request would make every episode take the same first choice), so
the schedulers' episodes differ by sampling: each run's own critical path is the yardstick. The
critical path is the longest single episode's own chain: its tool calls plus its turns, each turn
timed as the server takes to generate that many tokens for one conversation alone.

A single draw is decided by where its few slowest calls land, so `--draws N` repeats all three
schedulers on N latency sequences (seeds seed..seed+N-1) and reports each ratio's mean and range.
"""

import argparse
import itertools
import math
import random
import statistics
import tempfile
import threading
import time

from common import print_table
from prepare_models import make_tiny_agent_model
from transformers import AutoTokenizer
from vllm_cpu import VLLMCPUServer

from mt_grpo_trainer import MultiTurnToolEnv, VLLMServerClient
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.base.protocol import ToolCall, Turn, XMLProtocol
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples

MEDIAN, P99 = 0.2, 4.0
SIGMA = math.log(P99 / MEDIAN) / 2.326  # the 99th percentile of a standard normal
SCHEDULERS = [("lock-step rounds", "rounds", 64),  # (name, rollout_scheduler, conversations per request)
              ("per episode, merged requests (64 per request)", "per_episode", 64),
              ("per episode, one conversation per request", "per_episode", 1)]


class LongTailSearch:
    """The search tool, sleeping for the next latency of a seeded lognormal sequence."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.latencies = iter([rng.lognormvariate(math.log(MEDIAN), SIGMA) for _ in range(100_000)])
        self.lock = threading.Lock()

    def __call__(self, query: str) -> str:
        with self.lock:
            seconds = next(self.latencies)
        time.sleep(seconds)
        return f"Veltria: Veltria is a country in the north. Its capital is Morvane. (query: {query})"


class EveryCallRuns(XMLProtocol):
    """The tiny agent writes `<tool>` but its JSON rarely parses (it was taught without a system
    prompt), and a malformed call never reaches a tool. This benchmark measures scheduling, not the
    model: every call the model attempts is answered by the long-tail search, which the model's own
    tokens and turn structure are left as sampled."""

    def parse(self, text: str) -> Turn:
        turn = super().parse(text)
        return Turn(answer=turn.answer, calls=[ToolCall("search", c.arguments if not c.error else {"query": "?"})
                                               for c in turn.calls])


def make_search(tool: LongTailSearch):
    def search(query: str = "", **_) -> str:
        """Search the knowledge base."""
        return tool(query)

    return search


def generation_seconds(client: VLLMServerClient, prompt: list[int]) -> dict[int, float]:
    """Seconds the server takes to generate L tokens for one conversation alone, for a few L (a line fit)."""
    points = []
    for length in (4, 16, 32, 48):
        best = min(_timed(lambda: client.generate([prompt], [length], params=SamplingParams(temperature=1.0, seed=0)))
                   for _ in range(3))
        points.append((length, best))
    slope = (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
    return {"intercept": points[0][1] - slope * points[0][0], "per_token": slope}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def critical_path(episodes, fit) -> float:
    """The longest episode's own chain: its tool calls, plus each model turn generated alone."""
    chains = []
    for ep in episodes:
        turns = [s.end - s.start for s in ep.spans if s.role == "model"]
        chains.append(sum(c.seconds for c in ep.calls) + sum(fit["intercept"] + fit["per_token"] * n for n in turns))
    return max(chains)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draws", type=int, default=5, help="latency sequences, each run by every scheduler")
    ap.add_argument("--max-concurrent-requests", type=int, default=16,
                    help="vllm_max_concurrent_requests (the recipe default: 16); it bounds how many conversations "
                         "generate at once with one conversation per request")
    ap.add_argument("--temperature", type=float, default=0.5,
                    help="the tiny agent's calls mostly fail to parse at 1.0, and a call that fails never reaches the tool")
    args = ap.parse_args()

    model_dir = make_tiny_agent_model(tempfile.mkdtemp(prefix="bench-agent-"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with VLLMCPUServer(model_dir, "/tmp/bench-vllm.log", max_model_len=2048) as server:
        def run(scheduler: str, per_request: int, seed: int = args.seed):
            tool = LongTailSearch(seed)
            env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=EveryCallRuns(), tools=[make_search(tool)],
                                   max_env_steps=3, max_tokens_per_turn=48, max_completion_length=512,
                                   max_tool_response_tokens=48, tokenization_check="off", scheduler=scheduler,
                                   tool_max_workers=256, task_prompt=SEARCH_TASK_PROMPT, examples=search_examples)
            client = VLLMServerClient(base_url=f"http://127.0.0.1:{server.port}",
                                      params=SamplingParams(temperature=args.temperature),
                                      stop_strings=XMLProtocol.stop_strings, eos_token_ids=[tokenizer.eos_token_id],
                                      startup_timeout=30, max_concurrent_requests=args.max_concurrent_requests,
                                      prompts_per_request=per_request)
            prompts = [env.prompt(f"What is the capital of country number {i}?")
                       for i in range(args.prompts) for _ in range(args.generations)]
            t0 = time.perf_counter()
            episodes = env.rollout(prompts, client)
            return time.perf_counter() - t0, episodes, client

        run("rounds", 64)  # warm-up: compiles and caches on the server
        draws = []
        for draw in range(args.draws):
            seed = args.seed + draw
            draws.append({name: run(scheduler, per_request, seed) for name, scheduler, per_request in SCHEDULERS})
        _, episodes, client = draws[0]["lock-step rounds"]
        fit = generation_seconds(client, episodes[0].prompt_ids)

    # (seconds, critical path) of every scheduler in every draw, for the tables and the summary
    timings = [{name: (seconds, critical_path(episodes, fit)) for name, (seconds, episodes, _) in results.items()}
               for results in draws]
    for draw, results in enumerate(draws):
        rows = []
        for name, (seconds, episodes, _) in results.items():
            turns = [sum(s.role == "model" for s in ep.spans) for ep in episodes]
            calls = [c.seconds for ep in episodes for c in ep.calls]
            ran = sum(c.ok for ep in episodes for c in ep.calls)
            rows.append([name, seconds, timings[draw][name][1], sum(turns), f"{len(calls)} ({ran} ran)",
                         sum(sum(ep.model_mask) for ep in episodes), max(turns),
                         f"{max(calls):.2f}" if calls else "-"])
        print_table(f"Draw {draw + 1} of {args.draws} (latency seed {args.seed + draw}): long-tail tools, vllm-cpu "
                    f"tiny model, {args.prompts} prompts x {args.generations}, {args.max_concurrent_requests} "
                    f"requests in flight; tool latency lognormal (median {MEDIAN} s, p99 {P99} s), up to 4 turns",
                    ["scheduler", "seconds", "critical path s", "model turns", "tool calls (ran)", "model tokens",
                     "max turns", "slowest call s"], rows)

    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    rounds = [t["lock-step rounds"] for t in timings]
    print(f"\nOver {args.draws} draws, mean (lowest-highest):")
    print(f"lock-step rounds: {spread([s / path for s, path in rounds])} its critical path "
          "(the most any scheduler could gain on rounds is about this)")
    for name, _, _ in SCHEDULERS[1:]:
        runs = [t[name] for t in timings]
        print(f"{name}: {spread([r[0] / s for r, (s, _) in zip(rounds, runs)])} faster than rounds (target >= 2x); "
              f"{spread([s / path for s, path in runs])} its critical path (target <= 1.3x)")
    print(f"\n(one conversation alone: {fit['intercept'] * 1000:.0f} ms + {fit['per_token'] * 1000:.1f} ms per token; "
          f"tool latencies drawn: median {statistics.median(itertools.islice(LongTailSearch(args.seed).latencies, 2000)):.2f} s)")


if __name__ == "__main__":
    main()
