"""Where do a run's wrong answers come from? Sorts the recorded episodes of a run (RUN_DIR/rollouts/*.jsonl,
written with `save_rollouts_steps`) by what their final answer is, for the question-answering tasks:

    python scripts/answer_errors.py outputs/study/mt_grpo-s1                  # training and eval episodes
    python scripts/answer_errors.py outputs/study/mt_grpo-s1 --steps 20-30
    python scripts/answer_errors.py outputs/final/mt_grpo-s2 --strip studies/data/learning_study_final_runs/mt_grpo-s2

Each episode falls in one class, the first that holds:
  no answer            the episode ended without an <answer> (out of turns or tokens)
  exact                the answer is a gold alias (normalised as the exact-match reward does)
  holds the gold       the answer contains a gold alias among other words
  from the question    the answer is words of the question (the model names the question's entity)
  result document K    the answer is words of the K-th document (0 = first) of a result the episode saw
  in no result         none of the above: words the model made up
and two counts cut across them: wrong answers whose own <reasoning> holds a gold alias (the model wrote
the fact and answered something else), and episodes that saw a gold alias in a result. This is how
docs/results.md's ablation reads its runs' training episodes: which step of search-then-copy fails.
"exact" and "holds the gold" judge the answer as the rewards do (`mt_grpo.rewards.answers`: SQuAD-normalised text,
and numbers and math compared as values, so "35.0" is 35); the other classes match whole words of SQuAD-normalised
text (`mt_grpo.rewards.answers.normalize_answer`). The `<result>` blocks are read as the model saw them (cut to
`max_tool_response_tokens`), one document a line, as `mt_grpo.tools.search` writes them; the XML protocol's tags
are assumed.

`--strip OUT` keeps a run small enough to commit for this reading: it writes the training episodes
(RUN_DIR/rollouts/step-*.jsonl) to OUT/rollouts/ without their token arrays and prompt text (about a
sixth of the size), and copies RUN_DIR/trainer_state.json, each gzipped (.gz), as studies/data/*_runs/ keep them.
"""

import argparse
import json
import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for mt_grpo

from mt_grpo.base.protocol import ANSWER_PATTERN, XMLProtocol  # noqa: E402
from mt_grpo.rewards.answers import (contains_answer, contains_words, matches_answer, normalize_answer,  # noqa: E402
                                     normalized_aliases)
from view_rollouts import (load_rollouts, open_record, parse_steps, record_file,  # noqa: E402  (scripts/, here)
                           without_tokens, write_gzipped)

RESULT = re.compile(re.escape(XMLProtocol.RESULT_OPEN) + "(.*?)" + re.escape(XMLProtocol.RESULT_CLOSE), re.S)
TAG = re.compile(r"<[^>]*>")  # removed before normalising: it drops punctuation, so "Gate.</reasoning>" would fuse


def words(text: str) -> str:
    return normalize_answer(TAG.sub(" ", text))


def result_documents(episode: dict) -> list[str]:
    """The documents of every result the episode saw, in order, normalised: one a line of a <result>."""
    docs = []
    for turn in episode["turns"]:
        if turn["role"] == "env":
            for body in RESULT.findall(turn["text"]):
                docs += [words(line) for line in body.splitlines() if line.strip()]
    return docs


def classify(episode: dict) -> tuple[str, bool, bool]:
    """(class, gold in the reasoning of a wrong answer, gold seen in a result) for one recorded episode."""
    accepted = episode.get("answer_aliases") or episode["answer"]  # records before answer_aliases: a list in answer
    gold = normalized_aliases(accepted)
    docs = result_documents(episode)
    seen = any(contains_words(d, g) for d in docs for g in gold)
    last = episode["turns"][-1] if episode["turns"] else {"role": "env", "text": ""}
    match = ANSWER_PATTERN.search(last["text"]) if last["role"] == "model" else None
    if match is None:
        return "no answer", False, seen
    answer = words(match.group(1))
    if matches_answer(match.group(1), accepted):
        return "exact", False, seen
    reasoned = any(contains_words(words(last["text"][: match.start()]), g) for g in gold)
    if contains_answer(match.group(1), accepted):
        kind = "holds the gold"
    elif answer and contains_words(normalize_answer(episode["question"]), answer):
        kind = "from the question"
    else:
        where = next((k for k, d in enumerate(docs) if answer and contains_words(d, answer)), None)
        kind = "in no result" if where is None else f"result document {where}"
    return kind, reasoned, seen


CROSS_COUNTS = ("wrong answer, gold in its reasoning", "gold in a result it saw")


def tally(episodes: list[dict]) -> list[tuple[str, int]]:
    """The classes, most frequent first, then the two counts that cut across them."""
    classes, reasoned, seen = Counter(), 0, 0
    for episode in episodes:
        kind, in_reasoning, in_result = classify(episode)
        classes[kind] += 1
        reasoned += in_reasoning
        seen += in_result
    return classes.most_common() + list(zip(CROSS_COUNTS, (reasoned, seen)))


def strip_run(run_dir: str, out: str, steps: tuple[int, int] | None = None) -> int:
    """Copy the run's training episodes without `tokens` and `prompt_text`, and its trainer_state.json, to
    `out`, gzipped; returns the number of episodes written. The viewer needs the tokens; this script does not."""
    rollouts = {key: records for key, records in load_rollouts(run_dir, steps).items() if key.startswith("train")}
    if not rollouts:
        raise SystemExit(f"No recorded training episodes in {run_dir}/rollouts: run with --save_rollouts_steps N.")
    os.makedirs(os.path.join(out, "rollouts"), exist_ok=True)
    for key, records in rollouts.items():
        write_gzipped(os.path.join(out, "rollouts", f"step-{int(key.split('-')[1]):06d}.jsonl.gz"),
                      "".join(json.dumps(without_tokens(record)) + "\n" for record in records))
    if (state := record_file(os.path.join(run_dir, "trainer_state.json"))) is not None:
        with open_record(state) as f:
            write_gzipped(os.path.join(out, "trainer_state.json.gz"), f.read())
    return sum(len(records) for records in rollouts.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run's output_dir, holding rollouts/")
    ap.add_argument("--steps", type=parse_steps, help="only these steps, e.g. 20-30")
    ap.add_argument("--strip", metavar="OUT", help="write the training episodes, without token arrays and prompt "
                    "text, and trainer_state.json to OUT (to commit a run's episodes), then report on OUT")
    args = ap.parse_args()
    if args.strip:
        print(f"{strip_run(args.run_dir, args.strip, args.steps)} training episodes written to {args.strip}")
        args.run_dir = args.strip
    rollouts = load_rollouts(args.run_dir, args.steps)
    if not rollouts:
        raise SystemExit(f"No recorded episodes in {args.run_dir}/rollouts: run with --save_rollouts_steps N.")
    for mode in ("train", "eval"):
        episodes = [e for key, records in sorted(rollouts.items()) if key.startswith(mode) for e in records]
        if not episodes:
            continue
        print(f"{mode}: {len(episodes)} episodes of {sum(k.startswith(mode) for k in rollouts)} steps")
        for kind, n in tally(episodes):
            print(f"  {kind:<36} {n:>5}  {n / len(episodes):.2f}")


if __name__ == "__main__":
    main()
