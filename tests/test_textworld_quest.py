"""The textworld_quest environment (tasks/textworld_quest.py): a seed's game and its first observation, exact and
the same in any process; scripted play with hand-checked step rewards (optimal, detours, an invalid command, a
call after the end, a lost game); step_rewards starting over on reset; the tool's schema as TRL and transformers
build it; TRL's probe of the class finding exactly reset, get_reward and the tool; the dataset's disjoint splits;
the worked example. Seed 0's game, as its goal says: open the Henderson's box in the cellar, take the shadfly from
it, drop the shadfly (L0 = 3, so one step of the quest is worth 1/3)."""

import inspect
import json
import math
import os

import pytest
from transformers.utils import get_json_schema

from mt_grpo.rollout.environments import check_environment, tool_methods
from mt_grpo.base.protocol import check_examples
from mt_grpo.tasks.textworld_quest import (EXAMPLE_GAME, INVALID_REWARD, LOSS_REWARD, PROMPT, SPLIT_SEEDS,
                                           TextWorldQuest, accepted, game_examples, load, valid_command_rate, won)

THIRD = pytest.approx(1 / 3)
SOLUTION = ["open Henderson's box", "take shadfly from Henderson's box", "drop shadfly"]  # seed 0's quest
SEED_0_START = (
    "\n\nGoal: Who's got a virtual machine and is about to play through an fast paced round of TextWorld? You do! "
    "Here is how to play! Your first objective is to make sure that the Henderson's box inside the cellar is ajar. "
    "And then, recover the shadfly from the Henderson's box. Then, throw the shadfly on the floor of the cellar. "
    "Got that? Good!\n"
    "You are in the cellar. Exits: north to the shower.\n"
    "Here: Henderson's box (closed), worm.\n"
    "You carry: Henderson's latchkey.\n"
    "Actions: drop Henderson's latchkey, go north, lock Henderson's box with Henderson's latchkey, "
    "open Henderson's box, take worm.")


@pytest.fixture
def env():
    game = TextWorldQuest()
    game.reset(seed=0, prompt=[{"role": "user", "content": PROMPT}])  # the trainer passes the row's prompt too
    return game


def test_reset_gives_the_seeds_game_the_same_in_any_process():
    # the text was recorded in another process: TextWorld's generation depends on the seed alone
    assert TextWorldQuest().reset(seed=0) == SEED_0_START
    other = TextWorldQuest().reset(**EXAMPLE_GAME)  # another seed, another game
    assert other != SEED_0_START and "You are in the shower." in other


def test_optimal_play_wins_with_a_third_per_action(env):
    outputs = []
    for command in SOLUTION:
        outputs.append(env.act(command))
        assert env.get_reward() == pytest.approx(len(outputs) / 3)  # the share of the quest done
    assert env.step_rewards == [THIRD, THIRD, THIRD]
    assert outputs[0].startswith("Done: open Henderson's box.\n")
    assert "Here: Henderson's box (open, holding shadfly), worm." in outputs[0]
    assert "You carry: Henderson's latchkey, shadfly." in outputs[1]
    assert outputs[-1] == "Done: drop shadfly.\nThe quest is complete: you won."
    assert env.get_reward() == 1.0


def test_won_metric_counts_won_games_only(env):
    halfway = TextWorldQuest()
    halfway.reset(seed=0)
    halfway.act(SOLUTION[0])
    for command in SOLUTION:
        env.act(command)
    assert won([], [], environments=[env, halfway, object()]) == [1.0, 0.0, None]  # None: another environment's


def test_wrong_actions_undo_progress_and_cost_reward(env):
    # (command, step reward): leaving the room, closing or locking the box adds an action to the quest
    script = [("take worm", 0.0), ("go north", -1 / 3), ("go south", 1 / 3), ("open Henderson's box", 1 / 3),
              ("close Henderson's box", -1 / 3), ("lock Henderson's box with Henderson's latchkey", -1 / 3),
              ("unlock Henderson's box with Henderson's latchkey", 1 / 3), ("Open the HENDERSON'S box.", 1 / 3),
              ("take shadfly from Henderson's box", 1 / 3), ("drop shadfly", 1 / 3)]
    outputs = [env.act(command) for command, _ in script]
    assert env.step_rewards == [pytest.approx(r) for _, r in script]
    assert outputs[7].startswith("Done: open Henderson's box.\n")  # the command as the game writes it
    assert sum(env.step_rewards) == pytest.approx(1.0) and env.get_reward() == 1.0


def test_partial_reward_is_clipped_at_zero(env):
    env.act("go north")
    assert env.step_rewards == [pytest.approx(-1 / 3)] and env.get_reward() == 0.0  # L = 4 > L0 = 3


def test_invalid_command_is_answered_names_the_choices_and_spends_a_call(env):
    """Answered, not raised: the call runs (the trainer counts it as tool_ok), the game does not change."""
    assert env.act("dance").startswith("'dance' is not an action you can take here. Nothing happens. Choose one "
                                       "of: drop ")
    # valid later, not while the box is closed
    assert "not an action" in env.act("take shadfly from Henderson's box")
    assert env.step_rewards == [INVALID_REWARD, INVALID_REWARD] == [0.0, 0.0]  # one value per call, as promised
    assert env.get_reward() == 0.0
    env.act("open Henderson's box")  # the game did not change: the first action still comes first
    assert env.step_rewards[-1] == THIRD


def test_a_call_after_the_game_ended_raises(env):
    for command in SOLUTION:
        env.act(command)
    with pytest.raises(ValueError, match="The game is over: you won. Do not call act again"):
        env.act("take worm")
    assert env.step_rewards[-1] == INVALID_REWARD and env.get_reward() == 1.0


def recorded_episode(calls: list[tuple[str, str]]) -> dict:
    """A recorded episode (reporting.episode_records' fields that valid_command_rate reads): a model turn and an env
    turn per call, the env turn holding the call's name and the game's reply."""
    turns = []
    for name, output in calls:
        turns += [{"role": "model", "text": "<tool>...</tool>"},
                  {"role": "env", "text": f"<result>{output}</result>",
                   "tool_calls": [{"name": name, "output": output}]}]
    return {"turns": turns, "tool_calls": [{"name": name} for name, _ in calls]}


def test_the_valid_command_rate_counts_the_commands_the_game_carried_out(env):
    """Episode 1: 'dance' (invalid: answered, a call that ran), the quest's first action (accepted), a call that did
    not parse (no tool name: not a command) -> 1 of 2 act calls. Episode 2 plays the quest out (3 accepted) and calls
    again after the win (an error) -> 3 of 4. Over both: 4 of 6. No act call at all: NaN."""
    first = [("act", env.act("dance")), ("act", env.act(SOLUTION[0])), ("", "Error: the call did not parse")]
    assert [accepted(reply) for _, reply in first] == [False, True, False]
    assert valid_command_rate([recorded_episode(first)]) == 0.5
    game = TextWorldQuest()
    game.reset(seed=0)
    second = [("act", game.act(command)) for command in SOLUTION]
    with pytest.raises(ValueError) as over:
        game.act("take worm")
    second.append(("act", f"Error: {over.value}"))
    assert valid_command_rate([recorded_episode(second)]) == 0.75
    assert valid_command_rate([recorded_episode(first), recorded_episode(second)]) == 4 / 6
    assert math.isnan(valid_command_rate([recorded_episode([])]))


def test_the_baseline_script_reads_a_runs_recorded_evaluations(tmp_path):
    """scripts/game_baseline.py --records: per recorded evaluation (gzipped, as --keep keeps it), the games won, the
    mean quest progress (the recorded TextWorldQuest reward), the step rewards, calls per episode and the share of
    commands accepted. Two games: won in 3 accepted calls; 'dance' twice and one action (progress 1/3)."""
    from game_baseline import play, recorded_evaluations, summarize
    from view_rollouts import write_gzipped

    game = TextWorldQuest()
    game.reset(seed=0)
    won_calls = [("act", game.act(command)) for command in SOLUTION]
    other = TextWorldQuest()
    other.reset(seed=0)
    part_calls = [("act", other.act(c)) for c in ("dance", "dance", SOLUTION[0])]
    records = []
    episodes = ((won_calls, 1.0, [1 / 3] * 3), (part_calls, 1 / 3, [0.0, 0.0, 1 / 3]))
    for group, (calls, reward, steps) in enumerate(episodes):
        record = recorded_episode(calls)
        for turn, step_reward in zip([t for t in record["turns"] if t["role"] == "env"], steps):
            turn["step_rewards"] = [step_reward]
        records.append({**record, "step": 10, "mode": "eval", "group": group, "sample": 0,
                        "rewards": {"outcome": {"TextWorldQuest": reward}}})
    os.makedirs(tmp_path / "run" / "rollouts")
    write_gzipped(str(tmp_path / "run" / "rollouts" / "eval-step-000010.jsonl.gz"),
                  "".join(json.dumps(r) + "\n" for r in records))
    ((step, row),) = recorded_evaluations(str(tmp_path / "run"))
    assert step == 10 and row["games"] == 2 and row["solved"] == 0.5 and row["calls"] == 3.0
    assert row["reward"] == pytest.approx(2 / 3) and row["steps"] == pytest.approx(2 / 3)
    assert row["valid"] == 4 / 6
    # random play among the listed actions only plays valid commands; the oracle wins in its 3
    import random

    assert summarize([play(TextWorldQuest(), {"seed": 0}, "random_valid", 6, random.Random(0))])["valid"] == 1.0
    oracle = play(TextWorldQuest(), {"seed": 0}, "oracle", 6, random.Random(0))
    assert (oracle["solved"], oracle["calls"], oracle["accepted"]) == (True, 3, 3)


def apple_game():
    """A hand-made game (the generated ones cannot be lost, and seldom have doors): a kitchen with a table and a
    closed door north to the hall, the player holding an apple, and the quest "put apple on table". Eating the apple
    loses it."""
    import textworld
    from textworld.generator.game import Event, GameProgression, Quest
    from textworld.generator.inform7 import Inform7Game

    maker = textworld.GameMaker()
    kitchen, hall = maker.new_room("kitchen"), maker.new_room("hall")
    maker.add_fact("closed", maker.new_door(maker.connect(kitchen.north, hall.south), name="wooden door"))
    maker.set_player(kitchen)
    table, apple = maker.new(type="s", name="table"), maker.new(type="f", name="apple")
    kitchen.add(table)
    maker.inventory.add(apple)
    # the quest from the logic engine's own action (GameMaker.set_quest_from_commands compiles the game for it)
    progress = GameProgression(maker.build())
    commands = Inform7Game(progress.game).gen_commands_from_actions(progress.valid_actions)
    maker.quests = [Quest(win_events=[Event(actions=[progress.valid_actions[commands.index("put apple on table")]])])]
    return maker.build()


def test_losing_move_ends_the_game():
    env, game = TextWorldQuest(), apple_game()
    assert env._start(game).endswith("You are in the kitchen. Exits: north to the hall through the wooden door "
                                     "(closed).\nHere: table.\nYou carry: apple.\n"
                                     "Actions: drop apple, eat apple, open wooden door, put apple on table.")
    assert env.act("eat apple") == "Done: eat apple.\nThe quest can no longer be completed: you lost."
    assert env.step_rewards == [LOSS_REWARD] and env.get_reward() == 0.0
    with pytest.raises(ValueError, match="you lost"):
        env.act("drop apple")
    env._start(game)  # the same game again: the lost episode left it as it was
    assert env.act("put apple on table").endswith("you won.") and env.step_rewards == [1.0]


def test_reset_starts_over(env):
    env.act("open Henderson's box")
    env.act("dance")
    assert len(env.step_rewards) == 2
    assert env.reset(seed=0) == SEED_0_START
    assert env.step_rewards == [] and env.get_reward() == 0.0
    env.act("open Henderson's box")  # the box was closed again: the new episode has its own state
    assert env.step_rewards == [THIRD]


def test_reset_without_a_seed_says_which_column_is_missing():
    with pytest.raises(ValueError, match=r"needs the row's `seed` as an int >= 0, got None"):
        TextWorldQuest().reset(prompt="play")


def test_act_before_reset_says_to_reset():
    with pytest.raises(RuntimeError, match="before reset"):
        TextWorldQuest().act("go north")


# ----------------------------------------------------------------------------------------------------------------
# The contract: TRL's probe, the tool schema

def test_trl_probe_finds_reset_get_reward_and_the_tool_only():
    env = TextWorldQuest()
    # as GRPOTrainer.__init__ lists an environment's members (on the class: no property is evaluated)
    functions = [name for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)]
    public = [name for name in functions if not name.startswith("_")]
    assert public == ["act", "get_reward", "reset"]
    tools = [name for name in public if name not in ("reset", "get_reward")]
    assert tools == ["act"] == [fn.__name__ for fn in tool_methods(env)]
    # no public member other than those (a property or class attribute would be read as part of the API)
    assert [name for name in dir(type(env)) if not name.startswith("_")] == ["act", "get_reward", "reset"]
    assert [name for name in vars(env) if not name.startswith("_")] == ["step_rewards"]
    assert check_environment(env, None, []) == [env.act]  # the trainer's start-up checks pass


def test_tool_schema_from_type_hints_and_docstring():
    env = TextWorldQuest()
    for tool in tool_methods(env):
        schema = get_json_schema(tool)  # raises on a missing hint or Args line
        assert schema["function"]["name"] == tool.__name__ and schema["function"]["description"]
        assert all(p["description"] for p in schema["function"]["parameters"]["properties"].values())
    assert get_json_schema(env.act)["function"]["parameters"] == {
        "type": "object", "required": ["command"],
        "properties": {"command": {"type": "string", "description": "One of the actions the game lists, written as "
                                                                   "listed."}}}


# ----------------------------------------------------------------------------------------------------------------
# The dataset and the worked example

def test_load_draws_distinct_seeds_from_disjoint_split_ranges():
    train, test = load("train", 50, seed=0), load("test", 50, seed=0)
    assert train.column_names == ["seed", "prompt"] and len(train) == len(test) == 50
    assert set(train["prompt"]) == {PROMPT}
    assert len(set(train["seed"])) == 50 and set(train["seed"]) <= set(SPLIT_SEEDS["train"])
    assert set(test["seed"]) <= set(SPLIT_SEEDS["test"])
    assert not set(SPLIT_SEEDS["train"]) & set(SPLIT_SEEDS["test"])
    assert load("train", 50, seed=0)["seed"] == train["seed"] != load("train", 50, seed=1)["seed"]
    assert len(load("test")) == 100  # n None: the split's default size


@pytest.mark.parametrize("split, n, message", [("validation", 5, "splits train, test, not 'validation'"),
                                               ("test", 0, "asked for 0"), ("test", 10_001, "has 10000 games")])
def test_load_rejects_unknown_splits_and_sizes(split, n, message):
    with pytest.raises(ValueError, match=message):
        load(split, n, seed=0)


def test_game_examples_are_a_won_game_of_the_act_tool():
    env = TextWorldQuest()
    examples = check_examples(game_examples([env.act]), [env.act])
    assert EXAMPLE_GAME["seed"] not in SPLIT_SEEDS["train"] and EXAMPLE_GAME["seed"] not in SPLIT_SEEDS["test"]
    assert examples[0]["question"].startswith(PROMPT + "\n\nGoal: ")
    assert [step["args"]["command"] for step in examples[0]["steps"]] == ["take key from rack", "unlock box with key"]
    assert examples[0]["steps"][-1]["result"] == "Done: unlock box with key.\nThe quest is complete: you won."
    assert game_examples([]) == []


def test_the_cpu_recipe_trains_a_step(tiny_agent_dir, tmp_path):
    """hf_recipes/SmolLM2-135M-Instruct/textworld_quest.yaml as a user runs it, with the tiny model and one short
    step: the games load, the environment's rewards and the recipe's shaping rewards are logged."""
    import sys

    from helpers import final_metrics, rollout_records, run

    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", "hf_recipes/SmolLM2-135M-Instruct/textworld_quest.yaml",
         "--model_name_or_path", tiny_agent_dir, "--output_dir", out, "--max_steps", "1", "--eval_strategy", "no",
         "--max_samples", "4", "--num_generations", "4", "--gradient_accumulation_steps", "4",
         "--max_completion_length", "256", "--max_tokens_per_turn", "32", "--max_env_steps", "2",
         "--save_rollouts_steps", "1", "--max_prompt_length", "4096"], tmp_path)
    step = [h for h in final_metrics(out) if "loss" in h][0]
    for name in ("rewards/outcome/TextWorldQuest", "rewards/turn/TextWorldQuest_steps",
                 "rewards/turn/tool_execution_per_turn", "rewards/outcome/format_reward_func"):
        assert name in step, sorted(step)
    record = rollout_records(out)[0]
    assert "Goal:" in record["prompt_text"] and "Actions:" in record["prompt_text"]
    assert record["environment"] == "TextWorldQuest"
