"""Environment overhead per turn: CPU time MultiTurnToolEnv spends outside generation (parsing,
tool dispatch, template rendering, mask building) as episodes grow from 1 to 16 turns.

    .venv/bin/python studies/env_overhead.py

The policy is instant (pre-tokenized turns) and the tool returns at once, so what is timed is the
env alone. The cost per turn must stay flat as turns grow (no re-render of the whole conversation
per turn); the optional end-of-episode tokenization check re-renders once per episode.
"""

import time

from common import print_table, smollm2_dir
from transformers import AutoTokenizer

from mt_grpo.base.completions import Sample
from mt_grpo_trainer import MultiTurnToolEnv
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT, search_examples

CALL = '<reasoning>Search again.</reasoning>\n<tool>{"name": "search", "args": {"query": "capital of Veltria"}}</tool>'
ANSWER = "<reasoning>Done.</reasoning>\n<answer>Morvane</answer>"
RESULT = "Veltria: Veltria is a country in the north. Its capital is Morvane. " * 3


def search(query: str) -> str:
    """Search the knowledge base."""
    return RESULT


class InstantPolicy:
    """Calls the tool `turns - 1` times, then answers; counts the time spent inside generate."""

    external = False

    def __init__(self, tokenizer, turns):
        self.call = tokenizer.encode(CALL, add_special_tokens=False)
        self.answer = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.turns = turns
        self.seconds = 0.0
        self.tokenizer = tokenizer

    def another_round(self, has_work):
        return has_work

    def generate(self, prompts, max_tokens, n=1, params=None):
        t0 = time.perf_counter()
        out = []
        for ids in prompts:
            done = self.tokenizer.decode(ids).count("<result>\n")  # (excluded from the env's time)
            ids = self.answer if done >= self.turns - 1 else self.call
            out += [Sample(list(ids), [-0.1] * len(ids), "stop")] * n
        self.seconds += time.perf_counter() - t0
        return out


def main(batch=64, repeats=3):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    rows = []
    for check in ("off", "ignore_whitespace"):
        base = None
        for turns in (1, 2, 4, 8, 16):
            env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[search], max_env_steps=turns,
                                   max_tokens_per_turn=64,
                                   max_completion_length=200 * turns, max_tool_response_tokens=128,
                                   tokenization_check=check, few_shot=False, task_prompt=SEARCH_TASK_PROMPT,
                                   examples=search_examples)  # the knowledge base's prompt, as measured
            best = float("inf")
            for _ in range(repeats):
                policy = InstantPolicy(tokenizer, turns)
                t0 = time.perf_counter()
                episodes = env.rollout([env.prompt(f"Question {i}?") for i in range(batch)], policy)
                best = min(best, time.perf_counter() - t0 - policy.seconds)
            assert all(len([s for s in ep.spans if s.role == "model"]) == turns for ep in episodes)
            tokens = sum(len(ep.completion_ids) for ep in episodes) / batch
            per_turn = best / (batch * turns) * 1e6
            base = base or per_turn
            rows.append([check, turns, round(tokens), round(best / batch * 1e6), round(per_turn), f"{per_turn / base:.2f}x"])
    print_table(f"Env overhead, SmolLM2 tokenizer, batch {batch}, best of {repeats} (microseconds, 2-core CPU)",
                ["tokenization_check", "turns", "tokens/episode", "us/episode", "us/turn", "us/turn vs 1 turn"], rows)


if __name__ == "__main__":
    main()
