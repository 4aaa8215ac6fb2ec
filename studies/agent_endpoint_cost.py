"""What an agent program's rollout through the OpenAI-compatible endpoint (mt_grpo/agents/) costs, side by side in one
run on this machine:

  1. the knowledge-base task (its search tool, SmolLM2-135M in process, the same sampling) rolled out by the built-in
     loop and by an openai-SDK agent against the endpoint: wall time, model tokens, and the ratio of seconds per
     model token (goal: at most 1.15x);
  2. the endpoint's cost per call against a direct backend call, with 1 and 64 concurrent episodes of 4 calls each:
     the model (SmolLM2 in process, greedy, 8 tokens a call) called through the endpoint by async agents, against
     the same calls made directly (one batched generate per round, as the built-in loop makes them); and with an
     instant backend, the overhead alone in microseconds per call, in process (batched) and through `submit`.

    .venv/bin/python studies/agent_endpoint_cost.py [--repeats 2]

Wall and CPU times (the process's, all its threads: what other jobs on the machine do not change) are the best of
`repeats` (the two ways alternate), with torch on one thread; per call, in milliseconds.
"""

import argparse
import asyncio
import concurrent.futures
import os
import sys
import time

import torch
from accelerate import Accelerator
from common import ROOT, print_table, smollm2_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from mt_grpo.agents.runner import AgentEnv
from mt_grpo.base.completions import Sample
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.engine.sampling import SamplingParams, TransformersBackend
from mt_grpo.rollout.episodes import Episode
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, build_fictional_kb, search_examples
from mt_grpo.tools.search import make_search_tool
from mt_grpo_trainer import MultiTurnToolEnv

sys.path.insert(0, os.path.join(ROOT, "tests"))
from agent_programs.openai_tool_loop import tool_loop  # noqa: E402 - the tests' copy, timed here


def make_env(tokenizer, tools, **kw):
    kwargs = dict(tokenizer=tokenizer, protocol=XMLProtocol(), tools=tools, max_env_steps=2, max_tokens_per_turn=48,
                  max_completion_length=256, max_tool_response_tokens=64, tokenization_check="off",
                  task_prompt=SEARCH_TASK_PROMPT, examples=search_examples)
    return MultiTurnToolEnv(**{**kwargs, **kw})


def backend_of(model, tokenizer, temperature: float) -> TransformersBackend:
    backend = TransformersBackend(tokenizer=tokenizer, params=SamplingParams(temperature=temperature),
                                  eos_token_ids=[tokenizer.eos_token_id], stop_strings=XMLProtocol.stop_strings)
    backend.sync_weights(model, Accelerator(cpu=True))
    return backend


def best(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


# -- 1. the task, either way ---------------------------------------------------------------------------------------
def task_side_by_side(model, tokenizer, repeats: int, groups: int = 2, G: int = 4) -> list[list]:
    docs, rows = build_fictional_kb(seed=0)
    search = make_search_tool(docs)
    turns = dict(few_shot=True, max_tokens_per_turn=128, max_completion_length=512)  # worked examples: it searches
    builtin = make_env(tokenizer, [search], **turns)
    prompts = [builtin.prompt(r["question"]) for r in rows[:groups] for _ in range(G)]

    agent = AgentEnv(make_env(tokenizer, [search], **turns), agent=tool_loop(search), batch_wait=1.0)
    backend = backend_of(model, tokenizer, 1.0)
    results = {"built-in loop": [], "agent endpoint": []}
    for k in range(repeats):  # alternate, so that neither way gets the warmer machine
        for name, run in (("built-in loop", lambda: builtin.rollout(prompts, backend)),
                          ("agent endpoint", lambda: agent.rollout(None, backend, rows=[{"prompt": p}
                                                                                        for p in prompts]))):
            torch.manual_seed(k)
            t0, c0 = time.perf_counter(), time.process_time()
            episodes = run()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            results[name].append((seconds, cpu, sum(sum(ep.model_mask) for ep in episodes),
                                  sum(1 + ep.tool_turns for ep in episodes)))
    agent.endpoint.close()
    out, e, b = [], "agent endpoint", "built-in loop"
    for k in range(repeats):  # seed k: the same samples either way (the same prompts, batches and seed)
        for name in (b, e):
            seconds, cpu, tokens, calls = results[name][k]
            out.append([k, name, f"{seconds:.2f}", f"{cpu:.2f}", tokens, calls, f"{seconds / tokens * 1e3:.1f}",
                        f"{cpu / tokens * 1e3:.1f}"])
    best = lambda name, i: min(r[i] for r in results[name])  # noqa: E731
    out.append(["best", "ratio (endpoint / built-in)", f"{best(e, 0) / best(b, 0):.3f}x",
                f"{best(e, 1) / best(b, 1):.3f}x", "", "", "", ""])
    return out


# -- 2. per call -----------------------------------------------------------------------------------------------------
class InstantBackend:
    """Answers every call at once with the same 8 tokens: what is timed is everything but the model."""

    external = False

    def __init__(self, tokenizer, can_submit: bool):
        self.ids = tokenizer.encode(" Go on then.", add_special_tokens=False)[:8]
        self.can_submit = can_submit
        self.max_concurrent_requests, self.prompts_per_request = 64, 1
        self.pool = concurrent.futures.ThreadPoolExecutor(16)

    def generate(self, prompts, max_tokens, n=1, params=None):
        return [Sample(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts for _ in range(n)]

    def submit(self, prompts, max_tokens, n=1, params=None):
        return self.pool.submit(self.generate, prompts, [max_tokens], n, params)

    def another_round(self, has_work):
        return has_work


def direct(env, backend, episodes: int, calls: int) -> int:
    """The calls made straight to the backend: one batched generate per round, each reply appended (mask 0)."""
    eps = [Episode(env.render_ids([{"role": "user", "content": f"Question {i}?"}], True)) for i in range(episodes)]
    made = 0
    for _ in range(calls):
        samples = backend.generate([ep.context_ids for ep in eps], [8] * len(eps), 1)
        for ep, s in zip(eps, samples):
            ep.append("model", s.token_ids, s.logprobs)
            ep.messages.append({"role": "assistant", "content": "", "tool_calls": []})
            env.append_reply(ep, [{"role": "user", "content": "Go on."}])
            made += 1
    return made


async def chatty(row, client):
    """An async agent of `calls` calls, each extending the last (a clean append)."""
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(row["calls"]):
        m = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)).choices[0].message
        messages += [m.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]


def per_call(model, tokenizer, repeats: int, calls: int = 4) -> list[list]:
    env = make_env(tokenizer, [], max_completion_length=1024, max_tokens_per_turn=8, few_shot=False)
    agent = AgentEnv(env, agent=chatty, batch_wait=1.0)
    rows = []
    backends = [("SmolLM2 in process", lambda: backend_of(model, tokenizer, 0.0), "ratio"),
                ("instant, in process", lambda: InstantBackend(tokenizer, False), "us"),
                ("instant, submit", lambda: InstantBackend(tokenizer, True), "us")]
    for label, make, unit in backends:
        backend = make()
        for episodes in (1, 64):
            rows_in = [{"question": f"Question {i}?", "calls": calls} for i in range(episodes)]
            times = {"direct": [], "endpoint": []}  # (wall, CPU) seconds of each run
            for _ in range(repeats):  # alternating
                for name, run in (("direct", lambda: direct(env, backend, episodes, calls)),
                                  ("endpoint", lambda: agent.rollout(None, backend, rows=rows_in))):
                    t0, c0 = time.perf_counter(), time.process_time()
                    run()
                    times[name].append((time.perf_counter() - t0, time.process_time() - c0))
            n = episodes * calls
            (wd, cd), (we, ce) = (tuple(min(x) for x in zip(*times[k])) for k in ("direct", "endpoint"))
            rows.append([label, episodes, n, f"{wd / n * 1e3:.2f}", f"{we / n * 1e3:.2f}", f"{we / wd:.2f}x",
                         f"{cd / n * 1e3:.2f}", f"{ce / n * 1e3:.2f}", f"{(ce - cd) / n * 1e3:.2f}",
                         f"{ce / cd:.2f}x"])
    agent.endpoint.close()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2])
    a = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    asyncio.set_event_loop(asyncio.new_event_loop())
    if 1 in a.parts:
        print_table(f"1. The knowledge-base task, 2 groups of 4, SmolLM2-135M in process, temperature 1 ({a.repeats} "
                    "seeds, each the same samples both ways)",
                    ["seed", "rollout", "wall s", "CPU s", "model tokens", "model calls", "wall ms / token",
                     "CPU ms / token"], task_side_by_side(model, tokenizer, a.repeats))
    if 2 in a.parts:
        print_table(f"2. Per call, 4 calls an episode, 8 tokens a call (best of {a.repeats}, ms a call)",
                    ["backend", "episodes", "calls", "direct wall ms", "endpoint wall ms", "wall ratio",
                     "direct CPU ms", "endpoint CPU ms", "CPU overhead ms", "CPU ratio"],
                    per_call(model, tokenizer, a.repeats))


if __name__ == "__main__":
    main()
