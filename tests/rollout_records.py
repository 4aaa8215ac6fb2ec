"""Build a run folder of recorded rollouts in the trainer's schema (issue 11), for the viewer tests
and for the docs images, without training anything:

    RUN/rollouts/step-000001.jsonl, ..., RUN/rollouts/eval-step-000002.jsonl   # one episode a line
    RUN/trainer_state.json                                                      # log_history to plot

    python tests/rollout_records.py /tmp/fixture-run    # write one by hand

Each step holds 2 groups of 4 episodes of one question each: a tool call that finds the answer, a
call to an unknown tool (failed, "Error: ..."), a direct answer without tools, and two searches
that run out of environment steps. One token is `</script><b>x</b>` and tokens hold spaces, tabs and
newlines, to catch escaping bugs. Step 3 uses per-turn turn advantages (A_T is a list). The token
ids come from a toy word splitter, not a real tokenizer; everything else follows the trainer's
formulas: A = group-normalised reward, token advantage = A_O + A_T before the first <result>.
"""

import json
import math
import os
import random
import re
import sys
import zlib

# A toy tokenizer: the injection string and chat-template markers stay whole, words keep their space.
_TOKEN = re.compile(r"</script><b>x</b>|<\|im_(?:start|end)\|>| ?\w+|\n|[ \t]+|[^\w\s]")
ENV_TEXT = "<|im_end|>\n<|im_start|>user\n<result>\n{}\n</result><|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [  # (question, accepted answers, entity searched for)
    ("What is the capital of Ratomora?", ["Lotrowick"], "Ratomora"),
    ("Who founded the city of Veltria?", ["Morvane Ost", "Morvane"], "Veltria"),
]
UNKNOWN_TOOL_ERROR = "Error: unknown tool 'serch'; available tools: ['search']"


def tokenize(text: str) -> list[str]:
    pieces = _TOKEN.findall(text)
    assert "".join(pieces) == text, text  # the tokens must tile the text
    return pieces


def search_call(query: str) -> str:
    return json.dumps({"name": "search", "args": {"query": query}})


def episode_script(kind: str, answer: str, entity: str) -> list[tuple]:
    """The turns of one episode: ("model", text) or ("env", output, ok, tool name, args)."""
    fact = f"{entity}: a small country. Its capital is {answer}, founded by {answer}."
    if kind == "search_then_answer":
        return [("model", f"<reasoning>I should look up {entity}.</reasoning>\n<tool>{search_call(entity)}</tool>"),
                ("env", fact, True, "search", {"query": entity}),
                ("model", f"<reasoning>The result says {answer}.</reasoning>\n<answer>{answer}</answer>")]
    if kind == "unknown_tool":
        bad = json.dumps({"name": "serch", "args": {"query": entity}})
        return [("model", f"<reasoning>Search  it.</reasoning>\n<tool>{bad}</tool>"),
                ("env", UNKNOWN_TOOL_ERROR, False, "serch", {"query": entity}),
                ("model", "<reasoning>No luck.</reasoning>\n<answer>Paris</answer>")]
    if kind == "direct_answer":
        return [("model", "<reasoning>I think I know.\n\n\tIt is Paris.</reasoning>\n<answer>Paris</answer>")]
    if kind == "two_searches":  # runs out of environment steps; carries the injection token
        injection = "<reasoning>Look up </script><b>x</b> first.</reasoning>\n"
        return [("model", f"{injection}<tool>{search_call('</script>')}</tool>"),
                ("env", "No page matches '</script>'. Try <b>another</b> query & spelling.", True, "search",
                 {"query": "</script>"}),
                ("model", f"<reasoning>Try again.</reasoning>\n<tool>{search_call(entity)}</tool>"),
                ("env", fact, True, "search", {"query": entity}),
                ("model", "<reasoning>Now I")]
    raise ValueError(kind)


def normalise(values: list[float]) -> list[float]:
    """Group normalisation as the trainer does it: zero advantage when all rewards are equal."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [0.0 if std < 1e-8 else (v - mean) / std for v in values]


def build_episode(script: list[tuple], rng: random.Random) -> dict:
    """Tokens, turns and tool calls of a script; rewards and advantages are filled in by the group."""
    turns, tool_calls, texts, model_mask = [], [], [], []
    model_turn = -1
    for part in script:
        text = part[1] if part[0] == "model" else ENV_TEXT.format(part[1])
        pieces = tokenize(text)
        turn = {"role": part[0], "start": len(texts), "end": len(texts) + len(pieces), "text": text}
        if part[0] == "model":
            model_turn += 1
        else:
            _, output, ok, name, args = part
            seconds = round(rng.uniform(0.002, 0.05), 4)
            turn["tool_calls"] = [{"name": name, "args": args, "ok": ok, "seconds": seconds, "output": output}]
            tool_calls.append({"turn": model_turn, "name": name, "args": args, "ok": ok, "seconds": seconds})
        turns.append(turn)
        texts += pieces
        model_mask += [1 if part[0] == "model" else 0] * len(pieces)
    first_result = next((t["start"] for t in turns if t["role"] == "env"), len(texts))
    return {"turns": turns, "tool_calls": tool_calls, "first_result": first_result,
            "tokens": {"ids": [zlib.crc32(t.encode()) % 49152 for t in texts], "text": texts, "model_mask": model_mask}}


def score_group(episodes: list[dict], kinds: list[str], answer: str, per_turn: bool, mode: str, rng):
    """Rewards, R_T/R_O, A_T/A_O, stop reasons and per-token arrays of one group, in place."""
    for ep, kind in zip(episodes, kinds):
        calls = [t["tool_calls"][0] for t in ep["turns"] if t["role"] == "env"]
        found = [1.0 if answer in c["output"] else 0.0 for c in calls]
        answered = ep["turns"][-1]["text"].endswith("</answer>")
        tool_ok = 0.2 if calls and calls[0]["ok"] else 0.0
        ep["rewards"] = {
            "turn": {"tool_execution_reward_func": tool_ok,
                     "answer_in_result_per_turn": found if per_turn else None},
            "outcome": {"exact_match_reward_func": 1.0 if answer in ep["turns"][-1]["text"] else 0.0,
                        "format_reward_func": 0.2 if answered else 0.0}}
        ep["R_T"] = tool_ok + (found[0] if found else 0.0)
        ep["R_O"] = sum(ep["rewards"]["outcome"].values())
        ep["stop_reason"] = "answer" if answered else "max_env_steps"
    A_O = normalise([ep["R_O"] for ep in episodes])
    A_T = normalise([ep["R_T"] for ep in episodes])
    for ep, a_o, a_t in zip(episodes, A_O, A_T):
        ep["A_O"], ep["A_T"] = a_o, a_t
        # Per-turn mode: one turn advantage per tool turn (here: the first one's, then decaying).
        ep["A_T"] = [round(a_t * 0.5 ** k, 6) for k in range(len(ep["tool_calls"]))] if per_turn else a_t
        first_turn_adv = (ep["A_T"][0] if ep["A_T"] else 0.0) if per_turn else a_t
        tokens, n = ep["tokens"], len(ep["tokens"]["ids"])
        model = [m == 1 for m in tokens["model_mask"]]
        sampler = [round(-rng.expovariate(1.5), 6) if m else 0.0 for m in model]
        if mode == "eval":
            ep["A_O"] = ep["A_T"] = None
            tokens.update(advantage=[0.0] * n, sampler_logprob=sampler, trainer_logprob=None, is_weight=None)
            continue
        trainer = [round(s + rng.gauss(0, 0.03), 6) if m else 0.0 for s, m in zip(sampler, model)]
        tokens["advantage"] = [
            (a_o + (first_turn_adv if i < ep["first_result"] else 0.0)) if model[i] else 0.0 for i in range(n)]
        tokens["sampler_logprob"] = sampler
        tokens["trainer_logprob"] = trainer
        tokens["is_weight"] = [round(min(math.exp(t - s), 2.0), 6) if m else 1.0
                               for s, t, m in zip(sampler, trainer, model)]


def step_records(step: int, mode: str, seed: int, per_turn: bool = False) -> list[dict]:
    """The episodes of one step: 2 groups of 4, in group then sample order."""
    rng = random.Random(seed * 1000 + step * 2 + (mode == "eval"))
    records = []
    for group, (question, answers, entity) in enumerate(QUESTIONS):
        kinds = ["search_then_answer", "unknown_tool", "direct_answer", "two_searches"]
        if group == 1:  # a second group that mostly succeeds, so groups differ side by side
            kinds = ["search_then_answer", "search_then_answer", "unknown_tool", "direct_answer"]
        episodes = [build_episode(episode_script(k, answers[0], entity), rng) for k in kinds]
        score_group(episodes, kinds, answers[0], per_turn, mode, rng)
        prompt = ("<|im_start|>system\nAnswer the question. Call tools with <tool>{...}</tool>; answer with "
                  f"<answer>...</answer>.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        for sample, ep in enumerate(episodes):
            records.append({"step": step, "mode": mode, "group": group, "sample": sample,
                            "policy_version": step, "question": question, "answer": answers,
                            "prompt_text": prompt, **ep, "extra_key_the_viewer_ignores": {"x": 1}})
    return records


def log_history(steps: int, seed: int) -> list[dict]:
    """trainer_state.json's log_history: noisy rising rewards, a falling loss, eval every 5 steps."""
    rng = random.Random(seed)
    history = []
    for step in range(1, steps + 1):
        progress = step / steps
        noise = lambda scale: rng.gauss(0, scale)  # noqa: E731
        tool = min(1.0, 0.2 + 0.6 * progress + noise(0.05))
        history.append({
            "step": step, "loss": 0.05 * (1 - progress) + noise(0.01), "kl": 0.002 * step + abs(noise(0.002)),
            "rewards/turn/tool_execution_reward_func": 0.2 * tool,
            "rewards/turn/mean": 0.2 * tool + 0.5 * progress + noise(0.05),
            "rewards/outcome/exact_match_reward_func": 0.1 + 0.5 * progress + noise(0.05),
            "rewards/outcome/format_reward_func": 0.1 + 0.1 * progress,
            "rewards/outcome/mean": 0.2 + 0.6 * progress + noise(0.05),
            "rollout/tool_success_rate": tool, "rollout/answered_ratio": min(1.0, 0.5 + 0.4 * progress + noise(0.05)),
            "rollout/seconds": 4.0 + noise(0.5), "clip_ratio/region_mean": abs(noise(0.01)),
            "sampling/logprob_diff_first_turn": abs(noise(0.01)), "sampling/logprob_diff_later_turns": abs(noise(0.02)),
        })
        if step % 5 == 0:
            history.append({"step": step, "eval/exact_match": 0.1 + 0.5 * progress + noise(0.03),
                            "eval/tool_success_rate": tool + noise(0.03)})
    return history


def write_run(run_dir: str, seed: int = 0, train_steps=(1, 2, 3), eval_steps=(2,), logged_steps: int = 30) -> dict:
    """Write RUN_DIR/rollouts/*.jsonl and RUN_DIR/trainer_state.json; returns {file name: records}."""
    os.makedirs(os.path.join(run_dir, "rollouts"), exist_ok=True)
    files = {}
    for mode, steps in (("train", train_steps), ("eval", eval_steps)):
        for step in steps:
            name = f"{'eval-' if mode == 'eval' else ''}step-{step:06d}.jsonl"
            files[name] = step_records(step, mode, seed, per_turn=(mode == "train" and step == 3))
            with open(os.path.join(run_dir, "rollouts", name), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in files[name])
    with open(os.path.join(run_dir, "trainer_state.json"), "w") as f:
        json.dump({"global_step": logged_steps, "log_history": log_history(logged_steps, seed)}, f, indent=1)
    return files


if __name__ == "__main__":
    write_run(sys.argv[1])
    print(f"wrote {sys.argv[1]}/rollouts and {sys.argv[1]}/trainer_state.json")
