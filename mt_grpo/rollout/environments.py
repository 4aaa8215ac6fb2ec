"""Environments users bring: TRL's `environment_factory` contract, unchanged, plus per-step rewards as turn credit.

TRL 1.16's `GRPOTrainer(environment_factory=...)` takes a class (or any function returning an instance), or a dict
of them selected by each row's `environment` column. The trainer (recipe field `environment_factory:
module:Class`, or the constructor's argument) does what TRL does:
    one instance per episode   made once, pooled and reused: `reset(**row)` starts each episode
    reset(**row) -> str|None   the row's columns (`prompt`: the chat prompt the model sees); the string returned
                               is appended to the last user message
    public methods             every method not starting with `_`, besides reset and get_reward, is a tool: its
                               schema comes from its type hints and docstring (both tool formats); sync or async
    get_reward() -> float      optional, sync or async: an outcome reward with weight 1, logged under the class name
    environments=              every reward function also receives the episode's instances, in the batch's order

The extension, which TRL ignores (an attribute is not a method, so TRL exposes no tool for it):
    step_rewards: list[float]  the environment appends one value per tool step it judged (a game's score change,
                               a test that now passes); create it in `__init__` or in `reset` (found in the
                               class's source: has_step_rewards). The values a model turn's calls appended while
                               they ran, summed, are that turn's reward R_T, through a per-turn reward function
                               named `<Class>_steps` (weight 1): every tool turn's in `per_turn` mode, the first
                               turn's in `mt_grpo`. A turn whose calls appended nothing (or None) has no score: not
                               applicable, left out of the group's statistics (append 0.0 to score it 0).

Tool calls of one episode run one at a time, in order (they share the instance's state); episodes run
concurrently. A call past `tool_timeout` is waited for before the instance is touched again, and what it
appends late is credited to no turn; one that hangs past a second `tool_timeout` leaves its episode's rewards
None and its instance out of the pool (toolset.Toolset). See docs/guide.md, "Bring your own environment".
"""

import ast
import asyncio
import functools
import inspect
import logging
import textwrap
import threading
import time
import typing
from typing import Callable

from mt_grpo.base.protocol import holds_images, is_text_block
from mt_grpo.base.registry import resolve
from mt_grpo.engine.vision import image_content, is_image
from mt_grpo.rewards import reward_columns
from mt_grpo.rewards.conversation import count_tool_turns, per_tool_turn
from mt_grpo.rollout.user_turns import environment_done, environment_number, responds
from mt_grpo.base.runtime import in_thread, join, own_event_loop, run_async, stop_event_loop
from mt_grpo.rollout.tool_calls import clean_text, cut_tool_output, signal_scope
from mt_grpo.rollout.toolset import STEP_REWARD_TYPES, Toolset, settle_all

logger = logging.getLogger("mt_grpo")

CONTRACT = "TRL's environment_factory contract (docs/guide.md, 'Bring your own environment')"
RESERVED = ("reset", "get_reward", "respond", "end_episode")  # not tools: respond and end_episode are user_turns.py's


def episode_columns(inputs: list[dict], episodes: list) -> dict[str, list]:
    """What every reward function receives besides prompts and completions: the dataset's columns, `stop_reason` (each
    episode's: answer, budget, env_done, ...; ours), and, as TRL passes them, `environments`, each episode's
    environment instance (when the run has an environment_factory)."""
    columns = {**reward_columns(inputs), "stop_reason": [ep.stop_reason for ep in episodes]}  # why each episode ended
    stateful = [ep.toolset for ep in episodes if getattr(ep.toolset, "environment", None) is not None]
    # a timed-out call still running ends before any reward reads the instance: all waited for at once, one grace
    settle_all(stateful, max([t.timeout for t in stateful], default=0.0))
    if any(getattr(ep.toolset, "environment", None) is not None for ep in episodes):
        columns["environments"] = [ep.toolset.environment for ep in episodes]
    return columns


def load_factory(value) -> Callable | dict[str, Callable]:
    """The recipe's `environment_factory`: a dotted path `module:Class`, a dict {name: path} (several
    environments, selected by the `environment` column), or what the Python API passed (a class, a function, or a
    dict of them)."""
    if isinstance(value, dict):
        if not value:
            raise ValueError("`environment_factory` is an empty dict: map each `environment` column value to a "
                             "class, e.g. {game: my_module:Game}.")
        return {name: load_factory(v) for name, v in value.items()}
    if isinstance(value, str):
        return resolve(value, {}, "environment factory")
    if not callable(value):
        raise ValueError(f"`environment_factory` is a {type(value).__name__}; give a class (or a function returning "
                         "an instance), its dotted path `module:Class`, or a dict of them.")
    return value


def tool_methods(instance) -> list[Callable]:
    """The instance's tools, as TRL finds them: the public functions of its class, bound, besides reset and
    get_reward (listed on the class, so that no property is evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def check_environment(instance, name: str, standalone: list[Callable]) -> list[Callable]:
    """The instance's tools, after the checks that make a bad class fail at start-up, naming the fix."""
    label = type(instance).__name__ + (f" (environment {name!r})" if name is not None else "")
    if not callable(getattr(instance, "reset", None)):
        raise ValueError(f"{label} has no `reset` method. {CONTRACT} needs `def reset(self, **kwargs) -> str | None`, "
                         "which starts an episode from the dataset row and returns the first observation.")
    methods = tool_methods(instance)
    if not methods and not responds(instance):
        raise ValueError(f"{label} has no public method for the model to call, and no `respond` (user turns). Each "
                         "public method (not starting with `_`) besides reset, get_reward, respond and end_episode is "
                         "a tool.")
    for fn in methods:
        check_method(fn, label)
    clash = {fn.__name__ for fn in methods} & {fn.__name__ for fn in standalone}
    if clash:
        raise ValueError(f"{label}'s method(s) {sorted(clash)} have the name of a tool in `tools`, and the model "
                         "calls a tool by its name: rename the method, or drop the tool from `tools`.")
    return methods


def check_method(fn: Callable, label: str) -> None:
    if getattr(fn, "json_schema", None) is not None:  # its schema is given (an adapter's, an MCP server's)
        from mt_grpo.base.protocol import tool_schemas

        tool_schemas([fn])
        return
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation that does not resolve
        raise ValueError(f"{label}.{fn.__name__}: its type hints do not resolve ({e}).") from None
    missing = [p.name for p in params if p.name not in hints]
    if missing:
        raise ValueError(f"{label}.{fn.__name__} is a tool, and its argument(s) {missing} have no type hint: the "
                         f"model's schema is built from them. Annotate them, e.g. `{missing[0]}: str`, or make the "
                         "method private (`_name`) if it is not a tool.")
    if not (inspect.getdoc(fn) or "").strip():
        raise ValueError(f"{label}.{fn.__name__} is a tool without a docstring: the model reads what it does from "
                         "it. Write a Google-style docstring (one line, then `Args:` with a line per argument), "
                         "or make the method private (`_name`).")
    from mt_grpo.base.protocol import tool_schemas  # the schema both tool formats render; a bad docstring fails here

    tool_schemas([fn])


def accepted(method: Callable, kwargs: dict) -> dict:
    """The keywords of `kwargs` that `method` takes: all of them where it takes **kwargs; else the ones it names. The
    rows carry columns the trainer adds (`question`, ...) beside the dataset's, which TRL's reset never gets: a strict
    `reset(self, prompt, target)`, which TRL takes, failed here on `question`. A keyword it needs and the row lacks
    still fails, naming it."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}


def names_seed(reset) -> bool:
    try:
        return reset is not None and "seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return False


class EnvironmentPool:
    """The instances of a run's environments, handed out one per episode and returned after scoring. `tools(name)`
    are the tools a prompt of that environment lists (the standalone `tools` first, as TRL orders them)."""

    def __init__(self, factory, standalone: list[Callable], protocol):
        self.multi = isinstance(factory, dict)
        self.factories = factory if self.multi else {None: factory}
        self.standalone = list(standalone)
        self.free: dict = {}  # name -> instances not in use
        self.handed_out: dict[int, tuple] = {}  # id(instance) -> (name, the Toolset of its current episode)
        self.probe_tools: dict = {}  # name -> the probe instance's tools
        self.template_tools: dict = {}  # name -> their schemas for the chat template, made once
        self.steps: dict = {}  # name -> whether its class keeps step_rewards (has_step_rewards)
        self.replies: dict = {}  # name -> whether its class replies as the user (user_turns.responds)
        self.loops: dict = {}  # id(instance) -> its own event loop (loop_of)
        for name, make in self.factories.items():
            instance = make()
            self.probe_tools[name] = check_environment(instance, name, self.standalone)
            self.steps[name] = has_step_rewards(instance)
            self.replies[name] = responds(instance)  # user turns: a reply's score is its turn's reward
            self.free[name] = [instance]
            self.template_tools[name] = protocol.template_tools(self.tools(name))
        self.reward_funcs = self._reward_funcs()
        # a reset that names `seed` draws its game from it: each row gets one (run/builders.seed_rows), so that a
        # group's episodes play one game, not G games (TRL passes only the row's own columns)
        self.seeded = any(names_seed(getattr(probe, "reset", None)) for probe, *_ in self.free.values())

    def tools(self, name=None) -> list[Callable]:
        return self.standalone + self.probe_tools[self._known(name)]

    def all_tools(self) -> list[Callable]:
        """The union, each name once: what the env lists where an episode's environment is not known yet."""
        seen, tools = set(), []
        for name in self.factories:
            for fn in self.tools(name):
                if fn.__name__ not in seen:
                    seen.add(fn.__name__)
                    tools.append(fn)
        return tools

    def environment_name(self, row: dict):
        return self._known(row.get("environment"))

    def _known(self, name):
        """The factory's key for an `environment` value: None with a single factory (TRL reads no column then)."""
        if not self.multi:
            return None
        if name not in self.factories:
            raise ValueError(f"A row has `environment: {name!r}`, which is not a key of `environment_factory` "
                             f"({sorted(map(str, self.factories))}). Fix the row's `environment` column, or add "
                             "that environment.")
        return name

    def start(self, rows: list[dict], prompts: list[list[dict]], reset_timeout: float = 10.0,
              fit: Callable | None = None) -> tuple[list[list[dict]], list[Toolset]]:
        """An instance per row, reset with the row: the prompts with each observation appended to the last user
        message, and each episode's Toolset. The resets run at once, each on a thread of its own (on its instance's
        own event loop when async), within one `reset_timeout` for the batch, as tool calls do; a reset still running
        then makes its Toolset `stuck` (logged, naming the class and the row): its episode ends unplayed, without
        rewards, and its instance is not reused. So a reset must not rely on running alone (a tool call of another
        episode never did): one that holds the GIL (a game generated in Python) shares it with the batch's others.
        `fit(prompt, toolset, observation) -> observation`: the observation cut to the prompt budget."""
        if rows is None or len(rows) != len(prompts):
            raise ValueError("An env with an environment_factory resets each episode's instance with its dataset row: "
                             "pass `rows=` (one dict per prompt) to MultiTurnToolEnv.rollout.")
        toolsets = []
        for position, row in enumerate(rows):
            name = self.environment_name(row)
            instance = self.free[name].pop() if self.free[name] else self.factories[name]()
            functions = {fn.__name__: fn for fn in self.standalone + tool_methods(instance)}
            toolsets.append(Toolset(functions, self.template_tools[name], environment=instance, timeout=reset_timeout,
                                    label=row_label(row, position), loop=self.loop_of(instance)))
            self.handed_out[id(instance)] = (name, toolsets[-1])
        # all at once (TRL resets one at a time: eight hung resets cost eight timeouts there, one here)
        resets = [self._start_reset(toolset, row, prompt) for toolset, row, prompt in zip(toolsets, rows, prompts)]
        deadline = time.monotonic() + reset_timeout
        for thread, _ in resets:
            join(thread, max(0.0, deadline - time.monotonic()))
        for toolset, (thread, _) in zip(toolsets, resets):
            if thread.is_alive():
                toolset.running, toolset.running_call, toolset.stuck = thread, "reset", True
        if hung := [t for t in toolsets if t.stuck]:
            logger.warning("%d reset(s) still running after reset_timeout=%gs; those episodes end unplayed, without "
                           "rewards, and their instances are not reused: %s", len(hung), reset_timeout,
                           "; ".join(f"{type(t.environment).__name__}.reset ({t.label})" for t in hung))
        return [self._prompt(t, prompt, out, fit) for t, prompt, (_, out) in zip(toolsets, prompts, resets)], toolsets

    def _start_reset(self, toolset: Toolset, row: dict, prompt: list[dict]) -> tuple[threading.Thread, list]:
        """(the daemon thread running the instance's reset with the row's columns, the list its outcome lands in)."""
        instance = toolset.environment
        kwargs = {k: v for k, v in row.items() if k not in ("row", "environment", "answer_aliases")}  # the row's own
        kwargs = accepted(instance.reset, {**kwargs, "prompt": prompt})

        def reset():
            with signal_scope(f"{type(instance).__name__}.reset"):  # a `signal` call is skipped, never refused
                return run_async(instance.reset(**kwargs), toolset.loop)

        return in_thread(reset, f"reset-{type(instance).__name__}")

    def _prompt(self, toolset: Toolset, prompt: list[dict], out: list, fit: Callable | None) -> list[dict]:
        """The episode's prompt: the row's, with the reset's observation appended (cut to fit the prompt budget)."""
        if toolset.stuck:
            return prompt
        instance, label = toolset.environment, toolset.label
        ok, observation = out[0]
        if not ok and isinstance(observation, ConnectionError):  # a server's fault, retried where it was made
            raise RuntimeError(f"{type(instance).__name__}.reset failed for {label}: {observation}") from observation
        if not ok:
            raise RuntimeError(f"{type(instance).__name__}.reset raised {type(observation).__name__}: {observation}, "
                               f"for {label}. Fix the class, or the row (reset receives the row's columns as keyword "
                               "arguments).") from observation
        if observation is not None and (is_image(observation) or isinstance(observation, list)):  # engine/vision.py
            blocks = image_content(observation, f"{type(instance).__name__}.reset")
            if not holds_images(blocks):
                raise ValueError(f"{type(instance).__name__}.reset returned a list without an image for {label}; "
                                 "return the first observation as a string, an image, or text and image blocks.")
            blocks = [dict(p, text=clean_text(p["text"], f"{type(instance).__name__}.reset")) if is_text_block(p)
                      else p for p in blocks]
            last = prompt[-1]["content"]
            prompt = prompt[:-1] + [{**prompt[-1], "content": ([{"type": "text", "text": last}] if isinstance(
                last, str) else list(last)) + blocks}]  # the images, not cut: max_prompt_length counts text only
        elif observation is not None:
            if not isinstance(observation, str):
                raise ValueError(f"{type(instance).__name__}.reset returned a {type(observation).__name__} for "
                                 f"{label}; return the first observation as a string, or None.")
            observation = clean_text(observation, f"{type(instance).__name__}.reset")
            if fit is not None:
                observation = fit(prompt, toolset, observation)
            prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
        if environment_done(instance):
            raise ValueError(f"{type(instance).__name__}.done is True after reset for {label}, so its episode would end "
                             "at once: set `self.done = False` in `reset`.")
        if self.steps[self.handed_out[id(instance)][0]]:
            toolset.step_rewards()  # a wrong type, or none after reset, fails here, naming the class
            if getattr(instance, "step_rewards", None) is None:
                raise ValueError(f"{type(instance).__name__} sets `step_rewards`, but has none after reset for "
                                 f"{label}: set `self.step_rewards = []` in `reset`.")
        elif getattr(instance, "step_rewards", None) is not None:  # made where has_step_rewards could not see
            raise ValueError(f"{type(instance).__name__} has `step_rewards` after reset, but neither a new "
                             "instance nor the class's source showed it at start-up, so no turn reward reads it: "
                             "create it in `__init__` (`self.step_rewards = []`), or declare `step_rewards: "
                             "list[float]` on the class.")
        return prompt

    def loop_of(self, instance) -> asyncio.AbstractEventLoop | None:
        """The instance's own event loop, made at its first episode (base/runtime.own_event_loop), where its class has
        an async method; None for a sync-only class, which needs none (a thread and three file descriptors saved per
        instance)."""
        if id(instance) not in self.loops and has_async_methods(type(instance)):
            self.loops[id(instance)] = own_event_loop(type(instance).__name__)
        return self.loops.get(id(instance))

    def release(self, toolsets: list) -> None:
        """Return the episodes' instances once their rewards are read (a reward may read the final state). An
        instance still running a timed-out call (Toolset.settle) is dropped: a new one takes its place."""
        mine = [t for t in toolsets if getattr(t, "environment", None) is not None
                and id(t.environment) in self.handed_out]
        settle_all(mine, max([t.timeout for t in mine], default=0.0))  # one grace for the batch, none for the stuck
        self._end_episodes(mine)
        for toolset in mine:
            name, _ = self.handed_out.pop(id(toolset.environment))
            if not toolset.stuck:
                self.free[name].append(toolset.environment)
            elif (loop := self.loops.pop(id(toolset.environment), None)) is not None:
                stop_event_loop(loop)  # its thread ends once the stuck call returns, if it ever does

    def _end_episodes(self, toolsets: list) -> None:
        """Each instance's `end_episode()` (verl's release and finalize_interaction, OpenEnv's close), one at a time, on
        a thread within its tool_timeout; also for episodes that ended on an error or a timeout, but not while a call
        still runs (stuck: never touched again). One still running then, or raising, is logged; the instance is not
        reused after a hang."""
        for toolset in toolsets:
            instance = toolset.environment
            if toolset.stuck or not callable(getattr(instance, "end_episode", None)):
                continue
            outcome = toolset.bounded("end_episode", instance.end_episode, toolset.timeout)
            if outcome is None:
                toolset.stuck = True
                logger.warning("%s.end_episode still running after %gs (%s): the instance is not reused.",
                               type(instance).__name__, toolset.timeout, toolset.label)
            elif not outcome[0]:
                logger.warning("%s.end_episode raised %s: %s (%s)", type(instance).__name__,
                               type(outcome[1]).__name__, outcome[1], toolset.label)

    def stuck(self, instance) -> bool:
        """Whether `instance`'s episode left a timed-out call running past the grace (its rewards are None)."""
        return self.handed_out[id(instance)][1].stuck if id(instance) in self.handed_out else False

    def reward_of(self, instance):
        """`instance.get_reward()`, on a daemon thread (an async one on the instance's loop), within its episode's
        tool_timeout; None, logged, and the instance not reused, when it is still running then."""
        toolset = self.handed_out[id(instance)][1]
        outcome = toolset.bounded("get_reward", instance.get_reward, toolset.timeout)
        if outcome is None:
            toolset.stuck = True
            logger.warning("%s.get_reward still running after %gs (%s): the episode's reward is None and the instance "
                           "is not reused.", type(instance).__name__, toolset.timeout, toolset.label)
            return None
        ok, value = outcome
        if not ok:
            raise value
        return value

    def turn_rewards(self, instance) -> list[list[float]]:
        """What `instance` reported per model turn of its current episode: per tool turn (Toolset.turn_rewards), then
        the scores of the turn that ended it (a continuation's, a Reply(end=True)'s: Toolset.carry), if any."""
        toolset = self.handed_out[id(instance)][1]
        return toolset.turn_rewards + ([toolset.carry] if toolset.carry else [])

    # -- rewards ------------------------------------------------------------------------------------
    def _reward_funcs(self) -> tuple[list[Callable], list[Callable]]:
        """(outcome, turn) reward functions the environments bring: per class with `get_reward`, one named after
        the class; per class with `step_rewards` (self.steps), a per-turn one named `<Class>_steps`."""
        outcome, turn = [], []
        for name in self.probe_tools:
            cls = type(self.free[name][0])
            if callable(getattr(cls, "get_reward", None)) and cls.__name__ not in [f.__name__ for f in outcome]:
                outcome.append(_outcome_reward_func(cls, self))
            if (self.steps[name] or self.replies[name]) and f"{cls.__name__}_steps" not in [f.__name__ for f in turn]:
                turn.append(_step_reward_func(cls, self))
        return outcome, turn


def prompt_fitter(render_ids: Callable, tokenizer, max_prompt_length: int) -> Callable:
    """fit(prompt, toolset, observation) for EnvironmentPool.start: the observation, cut (with cut_tool_output's
    visible marker) so that the prompt it ends fits `max_prompt_length` tokens; a warning naming the class and the
    row, once per class. The dataset's prompts were already held to that length without it (tasks.build_dataset)."""
    warned: set[str] = set()

    def fit(prompt: list[dict], toolset: Toolset, observation: str) -> str:
        with_it = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
        over = len(render_ids(with_it, True, toolset)) - max_prompt_length
        if over <= 0:
            return observation
        own = len(tokenizer.encode(observation, add_special_tokens=False))
        cut = cut_tool_output(observation, tokenizer, max(0, own - over - CUT_MARKER_TOKENS))
        name = type(toolset.environment).__name__
        if name not in warned:
            warned.add(name)
            logger.warning("%s.reset's observation (%d tokens, %s) makes a prompt longer than max_prompt_length=%d: "
                           "cut to fit, with a marker (first time only; raise max_prompt_length, or return a shorter "
                           "observation).", name, own, toolset.label, max_prompt_length)
        return cut

    return fit


CUT_MARKER_TOKENS = 24  # room for cut_tool_output's "[truncated: N of M tokens shown]" line


def has_step_rewards(instance) -> bool:
    """Whether the class keeps `step_rewards`: the new instance has it, or a method of the class (or of a base)
    assigns `self.step_rewards` (in `reset`, say), or the class declares `step_rewards: list[float]`. Read from
    the source, so that no episode need start: the trainer picks its defaults from it at start-up. A wrong type
    on the new instance fails here, naming the class."""
    steps = getattr(instance, "step_rewards", None)
    if steps is not None:
        if not isinstance(steps, STEP_REWARD_TYPES):
            raise ValueError(f"{type(instance).__name__}.step_rewards is a {type(steps).__name__}; make it a list "
                             "of numbers (one appended per tool step), set to [] in `__init__` or `reset`.")
        return True
    for klass in type(instance).__mro__[:-1]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # no source to read (a class made at run time): only the instance tells
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            named = [n for t in targets for n in ast.walk(t)]  # `self.a, self.step_rewards = ...` too
            if any(isinstance(n, ast.Attribute) and n.attr == "step_rewards" or
                   isinstance(n, ast.Name) and n.id == "step_rewards" and isinstance(node, ast.AnnAssign)
                   for n in named):
                return True
    return False


@functools.cache
def has_async_methods(cls: type) -> bool:
    """Whether any method of the class (a tool, reset, respond, get_reward, end_episode) is async: only then do its
    instances get an event loop of their own (EnvironmentPool.loop_of)."""
    return any(inspect.iscoroutinefunction(fn) for _, fn in inspect.getmembers(cls, predicate=inspect.isfunction))


def row_label(row: dict, position: int) -> str:
    """A row as an error names it: its index in the dataset (else in the batch) and its first fields, cut."""
    index = f"row {row['row']}" if "row" in row else f"the batch's row {position}"
    fields = [(k, v) for k, v in row.items() if k not in ("row", "prompt")][:3]
    return index + " (" + ", ".join(f"{k}={str(v)[:40]!r}" for k, v in fields) + ")"


def _outcome_reward_func(cls: type, pool: EnvironmentPool) -> Callable:
    """`get_reward()` of each episode whose environment is exactly `cls` (None for the others, and for an episode
    whose timed-out call still runs: its state is not settled), as TRL scores it; bounded by the episode's
    tool_timeout (a get_reward still running then gives None, logged)."""

    def get_reward(prompts=None, completions=None, environments=None, **kwargs):
        values = []
        for environment in environments or []:
            value = pool.reward_of(environment) if type(environment) is cls and not pool.stuck(environment) else None
            values.append(None if value is None else environment_number(value, lambda: (
                f"{cls.__name__}.get_reward returned {value!r} ({type(value).__name__}); it must return a number (a "
                "float, or a numpy or torch scalar), the episode's reward.")))
        return values

    get_reward.__name__ = cls.__name__
    return get_reward


def _step_reward_func(cls: type, pool: EnvironmentPool) -> Callable:
    """Each tool turn's reward: the sum of the `step_rewards` the environment appended during that turn (a reply's
    score); and one more value, the final model turn's, when the turn that ended the episode was scored (gym's final
    step). A turn with no score (nothing appended, only None, a call that raised first) is None: not applicable."""

    @per_tool_turn
    def steps(prompts=None, completions=None, environments=None, **kwargs):
        values = []
        for completion, environment in zip(completions, environments, strict=True):
            turns = count_tool_turns(completion)
            if type(environment) is not cls or pool.stuck(environment):
                values.append([None] * turns)
                continue
            recorded = [[environment_number(v, lambda: f"{cls.__name__}.step_rewards holds {v!r} (tool turn {k}); append "
                                            "one number per tool step (a float, or a numpy or torch scalar).")
                         for v in step if v is not None]
                        for k, step in enumerate(pool.turn_rewards(environment)[:turns + 1])]
            values.append([float(sum(step)) if step else None for step in recorded] + [None] * (turns - len(recorded)))
        return values

    steps.__name__ = f"{cls.__name__}_steps"
    return steps
