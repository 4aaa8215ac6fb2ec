"""How hard is the textworld_quest game without a model? Plays it with random policies, through the environment's
own tools, and prints what each reaches:

    python scripts/game_baseline.py                       # 200 test games, 6 calls each (the recipes' max_env_steps)
    python scripts/game_baseline.py --split train --episodes 500 --max-calls 8

Policies, one episode per game each:
  oracle         the quest's shortest solution (TextWorld's winning policy): a check that every game is winnable
  random_valid   a uniform choice among the actions the last observation lists
  random_any     a command from TextWorld's verb templates ("take {o} from {c}", "go north", ...), each slot filled
                 with any name of the game (room, object, ...): a player who ignores the list; most are invalid
An episode ends when the game does (won, lost) or after --max-calls calls, as `max_env_steps` ends it in training.
Columns: solved (share won), reward (mean get_reward), steps (mean step_rewards summed), calls (mean calls made),
invalid (share of calls that raised). The trained model's numbers come from the trainer's evaluation.
"""

import argparse
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for tasks/

from tasks import textworld_quest  # noqa: E402
from tasks.textworld_quest import TextWorldQuest  # noqa: E402


def listed_actions(observation: str) -> list[str]:
    """The actions an observation lists (its last "Actions: a, b, c." line)."""
    lines = [line for line in observation.splitlines() if line.startswith("Actions: ")]
    return lines[-1][len("Actions: "):].rstrip(".").split(", ") if lines else []


def any_command(game, rng: random.Random) -> str:
    """A command a player who ignores the list could write: a verb template of the game, each slot any name."""
    names = [info.name for info in game.infos.values() if info.name]
    return re.sub(r"\{\w+\}", lambda _: rng.choice(names), rng.choice(game.command_templates))


def play(env: TextWorldQuest, row: dict, policy: str, max_calls: int, rng: random.Random) -> dict:
    observation = env.reset(**row)
    game = textworld_quest._make_game(row["seed"], textworld_quest.QUEST_LENGTH)  # the cached game env plays
    solution = list(env._inform7.gen_commands_from_actions(env._progress.winning_policy)) if policy == "oracle" else []
    calls = invalid = 0
    while calls < max_calls:
        if policy == "oracle":
            command = solution.pop(0)
        elif policy == "random_valid":
            command = rng.choice(listed_actions(observation))
        else:
            command = any_command(game, rng)
        calls += 1
        reply = env.act(command)
        if " is not an action you can take here." in reply:  # answered, and the game did not change
            invalid += 1
            continue
        observation = reply
        if "you won" in observation or "you lost" in observation:
            break
    reward = env.get_reward()
    return {"solved": reward == 1.0, "reward": reward, "steps": sum(env.step_rewards), "calls": calls,
            "invalid": invalid / calls}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="test", choices=sorted(textworld_quest.SPLIT_SEEDS))
    parser.add_argument("--episodes", type=int, default=200, help="games, one episode per policy each")
    parser.add_argument("--max-calls", type=int, default=6, help="act calls per episode at most (max_env_steps)")
    parser.add_argument("--seed", type=int, default=0, help="draws the games (as load's seed) and the policies")
    args = parser.parse_args()
    rows = textworld_quest.load(args.split, args.episodes, args.seed).to_list()
    env = TextWorldQuest()
    env.reset(**rows[0])  # the first game also imports TextWorld and loads its grammar
    started = time.perf_counter()
    for row in rows[1:]:  # generate every game first, to time generation apart from play
        env.reset(**row)
    generation = (time.perf_counter() - started) / max(1, len(rows) - 1)
    print(f"{len(rows)} {args.split} games, up to {args.max_calls} calls each; a new game takes {generation:.2f} s "
          "to generate, once (cached)")
    print(f"{'policy':<14}{'solved':>8}{'reward':>8}{'steps':>8}{'calls':>7}{'invalid':>9}{'ms/call':>9}")
    for policy in ("oracle", "random_valid", "random_any"):
        rng = random.Random(args.seed)
        started = time.perf_counter()
        results = [play(env, row, policy, args.max_calls, rng) for row in rows]
        per_call = (time.perf_counter() - started) / sum(r["calls"] for r in results) * 1000
        mean = {key: statistics.mean(float(r[key]) for r in results) for key in results[0]}
        print(f"{policy:<14}{mean['solved']:>8.3f}{mean['reward']:>8.3f}{mean['steps']:>8.3f}{mean['calls']:>7.2f}"
              f"{mean['invalid']:>9.3f}{per_call:>9.1f}")


if __name__ == "__main__":
    main()
