"""How hard is the textworld_quest game without a model, and what did a trained model's evaluation do on it? Plays
the game with random policies, through the environment's own tools, and prints what each reaches; or reads a run's
recorded evaluations (`--records`) and prints the same columns for the model:

    python scripts/game_baseline.py                       # 200 test games, 6 calls each (the recipes' max_env_steps)
    python scripts/game_baseline.py --episodes 32 --repeats 20   # the 32 test games a study evaluates (kb_seed 0)
    python scripts/game_baseline.py --split train --episodes 500 --max-calls 8
    python scripts/game_baseline.py --records studies/data/textworld_study_runs/per_turn-s1   # a run's evaluations

Policies, `--repeats` episodes per game each:
  oracle         the quest's shortest solution (TextWorld's winning policy): a check that every game is winnable
  random_valid   a uniform choice among the actions the last observation lists
  random_any     a command from TextWorld's verb templates ("take {o} from {c}", "go north", ...), each slot filled
                 with any name of the game (room, object, ...): a player who ignores the list; most are invalid
An episode ends when the game does (won, lost) or after --max-calls calls, as `max_env_steps` ends it in training.
`--episodes N --seed S` plays the games `textworld_quest.load("test", N, S)` draws, the ones a run with
`eval_max_samples: N` and `kb_seed: S` evaluates on. Columns: solved (share won), reward (mean get_reward: the
share of the quest done), steps (mean step_rewards summed), calls (mean calls made), valid (the share of calls whose
command the game accepted, over all calls: `textworld_quest.accepted`; an invalid command is answered, so
`eval/tool_success_rate` counts it as a call that ran). With `--records`, one row per recorded evaluation of each
run (rollouts/eval-step-*.jsonl, plain or gzipped: learning_study.py --keep), from the episodes' own rewards and
the game's replies (`textworld_quest.valid_command_rate`).
"""

import argparse
import os
import random
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repository, for mt_grpo

from mt_grpo.tasks import textworld_quest  # noqa: E402
from mt_grpo.tasks.textworld_quest import TextWorldQuest, accepted, valid_command_rate  # noqa: E402
from view_rollouts import load_rollouts  # noqa: E402  (scripts/, beside this file)

COLUMNS = ("solved", "reward", "steps", "calls", "valid")


def listed_actions(observation: str) -> list[str]:
    """The actions an observation lists (its last "Actions: a, b, c." line)."""
    lines = [line for line in observation.splitlines() if line.startswith("Actions: ")]
    return lines[-1][len("Actions: "):].rstrip(".").split(", ") if lines else []


def any_command(game, rng: random.Random) -> str:
    """A command a player who ignores the list could write: a verb template of the game, each slot any name."""
    names = [info.name for info in game.infos.values() if info.name]
    return re.sub(r"\{\w+\}", lambda _: rng.choice(names), rng.choice(game.command_templates))


def play(env: TextWorldQuest, row: dict, policy: str, max_calls: int, rng: random.Random) -> dict:
    """One episode of `policy` on the row's game: {solved, reward, steps, calls, accepted} (accepted: the calls
    whose command the game carried out)."""
    observation = env.reset(**row)
    game = textworld_quest.quest_game(row["seed"], textworld_quest.QUEST_LENGTH)  # the cached game env plays
    solution = textworld_quest.winning_commands(env) if policy == "oracle" else []
    calls = valid = 0
    while calls < max_calls:
        if policy == "oracle":
            command = solution.pop(0)
        elif policy == "random_valid":
            command = rng.choice(listed_actions(observation))
        else:
            command = any_command(game, rng)
        calls += 1
        reply = env.act(command)
        if not accepted(reply):  # answered, and the game did not change
            continue
        valid += 1
        observation = reply
        if "you won" in observation or "you lost" in observation:
            break
    reward = env.get_reward()
    return {"solved": reward == 1.0, "reward": reward, "steps": sum(env.step_rewards), "calls": calls,
            "accepted": valid}


def summarize(results: list[dict]) -> dict:
    """The columns over episodes: means per episode, and valid as the share of all calls (NaN without a call)."""
    calls = sum(r["calls"] for r in results)
    return {**{key: statistics.mean(float(r[key]) for r in results) for key in COLUMNS[:4]},
            "valid": sum(r["accepted"] for r in results) / calls if calls else float("nan")}


def recorded_evaluations(run_dir: str) -> list[tuple[int, dict]]:
    """(step, the columns) for each evaluation a run recorded: solved and reward from the episodes' recorded
    outcome reward (`TextWorldQuest`, the game's get_reward), steps from the game's step rewards, calls, and the
    valid-command rate from the game's replies. Empty when the run recorded no evaluation."""
    rows = []
    for key, records in load_rollouts(run_dir).items():
        if not key.startswith("eval-"):
            continue
        games = [r["rewards"]["outcome"]["TextWorldQuest"] for r in records]
        steps = [sum(x for turn in r["turns"] for x in turn.get("step_rewards", []) if x is not None) for r in records]
        rows.append((int(key.split("-")[1]), {
            "solved": statistics.mean(float(g == 1.0) for g in games), "reward": statistics.mean(games),
            "steps": statistics.mean(steps), "calls": statistics.mean(len(r["tool_calls"]) for r in records),
            "valid": valid_command_rate(records), "games": len(records)}))
    return rows


def row_text(label: str, mean: dict) -> str:
    return f"{label:<14}" + "".join(f"{mean[key]:>8.3f}" for key in COLUMNS)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="test", choices=sorted(textworld_quest.SPLIT_SEEDS))
    parser.add_argument("--episodes", type=int, default=200, help="games (rows of load(split, N, seed))")
    parser.add_argument("--repeats", type=int, default=1, help="episodes per game and policy (random play varies)")
    parser.add_argument("--max-calls", type=int, default=6, help="act calls per episode at most (max_env_steps)")
    parser.add_argument("--seed", type=int, default=0, help="draws the games (as load's seed, a run's kb_seed) and "
                        "the policies")
    parser.add_argument("--records", nargs="+", metavar="RUN_DIR", help="instead of playing: each run's recorded "
                        "evaluations (rollouts/eval-step-*.jsonl[.gz])")
    args = parser.parse_args()
    if args.records:
        print(f"{'run, step':<14}" + "".join(f"{key:>8}" for key in COLUMNS) + f"{'games':>7}")
        for run_dir in args.records:
            evaluations = recorded_evaluations(run_dir)
            if not evaluations:
                raise SystemExit(f"No recorded evaluation in {run_dir}/rollouts (eval-step-*.jsonl): run the study "
                                 "with its default record_flags, or the trainer with --save_rollouts_steps N.")
            print(os.path.basename(os.path.normpath(run_dir)))
            for step, mean in evaluations:
                print(row_text(f"  step {step}", mean) + f"{mean['games']:>7}")
        return
    rows = textworld_quest.load(args.split, args.episodes, args.seed).to_list()
    env = TextWorldQuest()
    env.reset(**rows[0])  # the first game also imports TextWorld and loads its grammar
    started = time.perf_counter()
    for row in rows[1:]:  # generate every game first, to time generation apart from play
        env.reset(**row)
    generation = (time.perf_counter() - started) / max(1, len(rows) - 1)
    print(f"{len(rows)} {args.split} games (seed {args.seed}), {args.repeats} episode(s) per game and policy, up to "
          f"{args.max_calls} calls each; a new game takes {generation:.2f} s to generate, once (cached)")
    print(f"{'policy':<14}" + "".join(f"{key:>8}" for key in COLUMNS) + f"{'ms/call':>9}")
    for policy in ("oracle", "random_valid", "random_any"):
        rng = random.Random(args.seed)
        started = time.perf_counter()
        results = [play(env, row, policy, args.max_calls, rng) for _ in range(args.repeats) for row in rows]
        per_call = (time.perf_counter() - started) / sum(r["calls"] for r in results) * 1000
        print(row_text(policy, summarize(results)) + f"{per_call:>9.1f}")


if __name__ == "__main__":
    main()
