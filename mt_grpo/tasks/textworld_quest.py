"""TextWorld quests: a stateful text game, offline, as the reference environment of TRL's `environment_factory`.

Each episode is one game that TextWorld (Microsoft's text-game generator, pip `textworld`) builds from the row's
`seed`: two rooms, five objects, and a quest of QUEST_LENGTH actions that the goal spells out in TextWorld's words
("Your first objective is to make sure that the Henderson's box inside the cellar is ajar. And then, recover the
shadfly from the Henderson's box. ..."). The model plays it through one tool, `act(command)`, choosing from the
actions the observation lists. State carries across turns (what is open, where the player and the objects are),
and a wrong action has consequences: walking away, closing the box again or dropping the key elsewhere makes the
quest longer (a negative step reward), and every call spends one of the episode's `max_env_steps`.

    env = TextWorldQuest()
    env.reset(seed=0)   # "\n\nGoal: ... the Henderson's box ... ajar. ...\nYou are in the cellar. ...\nActions: ..."
    env.act("open Henderson's box")   # "Done: open Henderson's box.\nYou are in the cellar. ..."
    env.step_rewards                  # [0.333...]: one of the quest's three actions done
    env.get_reward()                  # 0.333...; 1.0 once the quest is complete

The game runs on TextWorld's logic engine (`GameProgression`: the world's facts, the actions valid in them, the
quest's shortest remaining solution), not on a compiled Z-machine story file. That engine writes no text, so the
observation here is written from the facts: the room, its exits, what is there (and in or on it), what the player
carries, and the valid actions. Left out on purpose: compiling with Inform 7 (TextWorld's path to its own prose)
takes about 5 s per game against 0.4 s to generate one, and the compiled game opens with an ASCII-art banner (about
600 tokens in all, against 150 here); "examine", "look" and "inventory" are accepted but not listed, since the
observation already says what they would.

Rewards, hand-checkable. L0 is the length of the shortest winning sequence at the start, L the one now:
    step_rewards   one float per `act` call:
        (L_before - L_after) / L0   a valid action: +1/L0 toward the goal (the winning one included), -1/L0 away
                                    from it (leaving the room the quest needs), 0 for one the quest does not need
        LOSS_REWARD = -1.0          the action after which the quest can no longer be done: the game is lost
                                    (TextWorld's `failed`, such as eating the apple to put on the table; the games
                                    these settings generate have no such action: none in 600 seeds checked)
        INVALID_REWARD = 0.0        a command that is not a valid action here, or any call after the game ended:
                                    the game does not change, and the call's consequence is the turn it spent.
                                    An invalid command is answered, as text games answer one ("'dance' is not
                                    an action you can take here. Nothing happens. Choose one of: ..."), so the
                                    call runs (tool_ok): SmolLM2-135M's first act calls were nearly all
                                    invalid commands, and as errors they left the call format itself with no
                                    credit. A call after the game ended is an error: the tool is done.
                                    Not below zero: a call the trainer cannot parse, or to a tool that does not
                                    exist, never reaches the environment and earns its turn 0, and a small model
                                    makes those most (SmolLM2-135M called "action" in its first episodes). A
                                    penalty here would rank a well-formed `act` call with a wrong command below a
                                    malformed one, against learning the call format first.
    get_reward()   1.0 won, 0.0 lost, else the share of the quest done: max(0, 1 - L / L0).
On an episode not lost, the step rewards add up to 1 - L / L0: the same number as get_reward before its clip at 0.

`load(split, n, seed)` gives the rows {"seed", "prompt"}: training games from the seeds SPLIT_SEEDS["train"],
held-out ones from SPLIT_SEEDS["test"], which do not overlap. The same seed gives the same game in any process.
The task also brings its part of the system prompt (GAME_TASK_PROMPT), a worked game (`game_examples`) and its
eval metric, `eval/won` (TASK_EVAL_METRICS: the share of held-out games won). `valid_command_rate` reads the share
of commands the game accepted from an evaluation's recorded episodes (`scripts/game_baseline.py --records RUN`).
"""

import functools
import numbers
import random
import re
import threading

import datasets

SPLIT_SEEDS = {"train": range(0, 100_000), "test": range(100_000, 110_000)}  # disjoint: held-out games stay unseen
DEFAULT_SIZES = {"train": 1000, "test": 100}  # rows per split when `n` is None
NUM_ROOMS = 2
NUM_OBJECTS = 5  # the quest's objects, then distractors up to this many
# Actions the quest takes. With 3, a player choosing uniformly among the listed actions wins 6.5% of the games
# within 6 calls, 14.5% within 8, and gets a mean get_reward of 0.25 (scripts/game_baseline.py, 200 test games):
# a group of 8 samples mostly differs in progress, sometimes in a win.
QUEST_LENGTH = 3
LOSS_REWARD = -1.0
INVALID_REWARD = 0.0  # see the module docstring: a malformed call earns its turn 0 too
UNLISTED_VERBS = ("examine", "look", "inventory")  # valid, but change nothing and tell nothing the view does not
DONE = "Done: "  # how act's reply to a command the game carried out begins (`accepted`, valid_command_rate)

PROMPT = "Play this text game: reach the goal by calling the act tool, one action per call."
GAME_TASK_PROMPT = ("You play a text adventure game. Each turn, call the act tool with one of the actions the game "
                    "lists. When the game says you won, stop and answer.")
# The worked game of `game_examples`: a seed in neither split, a two-action quest (take the key from the rack,
# unlock the box with it), and a thought per action.
EXAMPLE_GAME = {"seed": 1_000_000, "quest_length": 2}
EXAMPLE_STEPS = [("take key from rack", "The goal says to pick up the key from the rack first. It is listed."),
                 ("unlock box with key", "I carry the key now, so I unlock the box with it.")]


# ------------------------------------------------------------------------------------------------
# The environment: one instance per episode, reset with a dataset row
# ------------------------------------------------------------------------------------------------
class TextWorldQuest:
    """A TextWorld game per episode; its one tool is `act`. See the module docstring for the rewards."""

    def __init__(self):
        self.step_rewards: list[float] = []  # one float per act call (the trainer's turn credit; TRL ignores it)
        self._game = self._inform7 = self._progress = None
        self._start_length = 0  # L0: the quest's shortest solution at the start
        self._remaining = 0  # L: the same now (0 once won)
        self._outcome = None  # None while playing, then "won" or "lost"

    def reset(self, **kwargs) -> str:
        """Start the game of the row's `seed` (and optional `quest_length`); return the goal and what the player
        sees. Every other column (`prompt`, ...) is ignored."""
        seed, quest_length = kwargs.get("seed"), kwargs.get("quest_length", QUEST_LENGTH)
        for name, value, least in (("seed", seed, 0), ("quest_length", quest_length, 1)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"TextWorldQuest.reset needs the row's `{name}` as an int >= {least}, got "
                                 f"{value!r}. Build the rows with mt_grpo.tasks.textworld_quest.load, or give each "
                                 "a `seed` column.")
        with _TEXTWORLD:  # the trainer resets a batch's instances at once; TextWorld's generator and parser share state
            return self._start(quest_game(int(seed), int(quest_length)))

    def act(self, command: str) -> str:
        """Do one action in the text game, such as "open chest", "take key" or "go north".

        Args:
            command: One of the actions the game lists, written as listed.
        """
        if self._progress is None:
            raise RuntimeError("TextWorldQuest.act was called before reset: reset(seed=...) starts a game.")
        if self._outcome is not None:
            self.step_rewards.append(INVALID_REWARD)
            raise ValueError(f"The game is over: you {self._outcome}. Do not call act again; give your answer.")
        command, action = self._valid_actions().get(_normalize(command), (command, None))
        if action is None:  # the game's answer, not a failed call: the act call itself was well formed
            self.step_rewards.append(INVALID_REWARD)
            return (f"{command!r} is not an action you can take here. Nothing happens. Choose one of: "
                    f"{', '.join(self._listed_commands())}.")
        self._progress.update(action)
        return f"{DONE}{command}.\n" + self._score_step()  # the command as the game writes it

    def get_reward(self) -> float:
        """1.0 if the quest is complete, 0.0 if lost, else the share of it done (module docstring)."""
        if self._outcome is not None:
            return 1.0 if self._outcome == "won" else 0.0
        return max(0.0, 1.0 - self._remaining / self._start_length)

    # -- private helpers ----------------------------------------------------------------------------------------
    def _start(self, game) -> str:
        """Play `game` (a TextWorld Game, generated or hand-made) from its start: the first observation."""
        from textworld.generator.game import GameProgression
        from textworld.generator.inform7 import Inform7Game

        self._game, self._inform7 = game, Inform7Game(game)
        self._progress = GameProgression(game)  # this episode's copy of the state: the game stays read-only
        if not self._progress.winning_policy:
            raise ValueError("This TextWorld game has no quest to win (no winning policy): give the game a quest "
                             "(GameMaker.quests), or generate it with quest_length >= 1.")
        self._start_length = self._remaining = len(self._progress.winning_policy)
        self._outcome = None
        self.step_rewards = []
        return f"\n\nGoal: {game.objective}\n{self._view()}"

    def _score_step(self) -> str:
        """Append the last action's step reward and say what follows: the end of the game, or the new view."""
        if self._progress.completed:
            self._outcome = "won"
            self.step_rewards.append(self._remaining / self._start_length)  # the last step: L_after = 0
            self._remaining = 0
            return "The quest is complete: you won."
        policy = self._progress.winning_policy
        if self._progress.failed or policy is None:
            self._outcome = "lost"
            self.step_rewards.append(LOSS_REWARD)
            return "The quest can no longer be completed: you lost."
        self.step_rewards.append((self._remaining - len(policy)) / self._start_length)
        self._remaining = len(policy)
        return self._view()

    def _valid_actions(self) -> dict:
        """Normalised command -> (the command as the game writes it, its TextWorld action), for every action
        valid now (listed or not)."""
        actions = self._progress.valid_actions
        commands = self._inform7.gen_commands_from_actions(actions)
        return {_normalize(command): (command, action) for command, action in zip(commands, actions)}

    def _listed_commands(self) -> list[str]:
        commands = self._inform7.gen_commands_from_actions(self._progress.valid_actions)
        return sorted({c for c in commands if not c.startswith(UNLISTED_VERBS)})

    def _view(self) -> str:
        """What the player sees, from the state's facts: room and exits, things here, inventory, actions."""
        facts = [(f.name, [a.name for a in f.arguments]) for f in self._progress.state.facts]
        room = next(args[1] for name, args in facts if name == "at" and args[0] == "P")
        held = {}  # container or supporter id -> the ids in or on it
        for name, args in facts:
            if name in ("in", "on") and args[1] != "I":
                held.setdefault(args[1], []).append(args[0])
        states = {args[0]: name for name, args in facts if name in ("open", "closed", "locked")}
        here = [args[0] for name, args in facts if name == "at" and args[1] == room and args[0] != "P"]
        carried = [args[0] for name, args in facts if name == "in" and args[1] == "I"]
        return "\n".join([
            f"You are in the {self._name(room)}. Exits: {', '.join(self._exits(facts, room, states)) or 'none'}.",
            f"Here: {', '.join(self._thing(t, states, held) for t in sorted(here, key=self._name)) or 'nothing'}.",
            f"You carry: {', '.join(sorted(self._name(t) for t in carried)) or 'nothing'}.",
            f"Actions: {', '.join(self._listed_commands())}.",
        ])

    def _exits(self, facts: list, room: str, states: dict) -> list[str]:
        """"north to the attic", and the door on the way if there is one ("... through the wooden door (closed)")."""
        doors = {(args[0], args[2]): args[1] for name, args in facts if name == "link"}  # link(r, d, r')
        exits = []
        for direction in ("north", "south", "east", "west"):
            for name, args in facts:
                if name == f"{direction}_of" and args[1] == room:  # north_of(r', r): r' lies north of r
                    door = doors.get((room, args[0]))
                    through = f" through the {self._name(door)} ({states.get(door, 'open')})" if door else ""
                    exits.append(f"{direction} to the {self._name(args[0])}{through}")
        return exits

    def _thing(self, entity: str, states: dict, held: dict) -> str:
        """An entity as the view shows it: a container with its state (and contents when open), a supporter with
        what is on it."""
        name, inside = self._name(entity), sorted(self._name(t) for t in held.get(entity, []))
        kind = self._game.infos[entity].type
        if kind == "c":
            state = states.get(entity, "open")
            if state != "open":
                return f"{name} ({state})"
            return f"{name} (open, holding {', '.join(inside)})" if inside else f"{name} (open, empty)"
        if kind == "s" and inside:
            return f"{name} (on it: {', '.join(inside)})"
        return name

    def _name(self, entity: str) -> str:
        return self._game.infos[entity].name


def _normalize(command: str) -> str:
    """Lower case, single spaces, no articles or end punctuation: "Take the key." and "take key" are one command."""
    words = re.sub(r"[.!?]+$", "", str(command).strip().lower()).split()
    return " ".join(w for w in words if w not in ("the", "a", "an"))


_TEXTWORLD = threading.Lock()  # one game made or started at a time (TextWorld's parser is not thread-safe)


# ------------------------------------------------------------------------------------------------
# Games: generated by TextWorld from a seed, cached (0.4 s each; the group of one prompt shares one)
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def quest_game(seed: int, quest_length: int):
    """The TextWorld Game of a seed; read-only once made (each episode plays on its own GameProgression)."""
    import textworld  # imported here: importing this module (for `load`, the prompts) stays light
    from textworld.generator import make_game

    options = textworld.GameOptions()
    options.seeds = seed
    options.nb_rooms, options.nb_objects, options.quest_length = NUM_ROOMS, NUM_OBJECTS, quest_length
    return make_game(options)


def winning_commands(quest: TextWorldQuest) -> list[str]:
    """The commands of the shortest solution from where `quest` (a reset TextWorldQuest) stands, as the game writes
    them: an oracle's moves (scripts/game_baseline.py). A function, not a method: each public method of the class is
    a tool the model may call."""
    return list(quest._inform7.gen_commands_from_actions(quest._progress.winning_policy))


def game_examples(tools: list) -> list[dict]:
    """One worked game (EXAMPLE_GAME) for few-shot prompts, played here so that every observation is the game's
    own; [] when the run has no `act` tool."""
    if "act" not in [fn.__name__ for fn in tools]:
        return []
    env = TextWorldQuest()
    question = PROMPT + env.reset(**EXAMPLE_GAME)
    steps = [{"thought": thought, "tool": "act", "args": {"command": command}, "result": env.act(command)}
             for command, thought in EXAMPLE_STEPS]
    return [{"question": question, "steps": steps, "thought": "The game says I won.", "answer": "I won the game."}]


# ------------------------------------------------------------------------------------------------
# The dataset: one row per game
# ------------------------------------------------------------------------------------------------
def load(split: str = "train", n: int | None = None, seed: int = 0) -> datasets.Dataset:
    """`n` rows {"seed": int, "prompt": str} of `split` (train | test): distinct game seeds drawn with `seed` from
    the split's range (SPLIT_SEEDS; disjoint). `n` None gives the split's DEFAULT_SIZES rows."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"textworld_quest has the splits {', '.join(SPLIT_SEEDS)}, not {split!r}; set "
                         "`dataset_split` (or `eval_dataset_split`).")
    n = DEFAULT_SIZES[split] if n is None else n
    if not 1 <= n <= len(SPLIT_SEEDS[split]):
        raise ValueError(f"textworld_quest's {split} split has {len(SPLIT_SEEDS[split])} games; asked for {n}. "
                         f"Set max_samples between 1 and {len(SPLIT_SEEDS[split])}.")
    seeds = random.Random(f"textworld_quest-{split}-{seed}").sample(SPLIT_SEEDS[split], n)
    return datasets.Dataset.from_dict({"seed": seeds, "prompt": [PROMPT] * n})


# ------------------------------------------------------------------------------------------------
# Evaluation: `eval/won` is the share of held-out games won (tasks.load_task registers it)
# ------------------------------------------------------------------------------------------------
def accepted(reply: str) -> bool:
    """Whether an `act` reply says the game carried the command out: not an invalid command (answered, so the call
    ran), not a call after the game ended (an error), not a call that never reached the game."""
    return reply.startswith(DONE)


def valid_command_rate(records: list[dict]) -> float:
    """The share of `act` calls whose command the game accepted, over recorded episodes (the trainer's
    rollouts/*.jsonl records, kept copies included): each env turn's `tool_calls` holds the calls it answers with
    the game's reply (`output`). `eval/tool_success_rate` counts an invalid command as a call that ran, since the game
    answers it; here it is not valid, and neither is a call after the game ended or one that did not parse. NaN when
    no episode called `act`."""
    calls = [call for record in records for turn in record["turns"] if turn["role"] != "model"
             for call in turn.get("tool_calls", []) if call["name"] == "act"]
    return sum(accepted(call["output"]) for call in calls) / len(calls) if calls else float("nan")


def won(prompts, completions, environments, **kwargs) -> list[float | None]:
    """1.0 for an episode whose game was won, else 0.0 (None for another environment's episode)."""
    return [float(env.get_reward() == 1.0) if isinstance(env, TextWorldQuest) else None for env in environments]


TASK_EVAL_METRICS = {"won": "mt_grpo.tasks.textworld_quest:won"}
