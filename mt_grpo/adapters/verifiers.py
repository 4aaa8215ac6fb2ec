"""A classic verifiers environment (`ToolEnv`, `StatefulToolEnv`, `MultiTurnEnv`: verifiers 0.1.x, and
`verifiers.legacy` in 0.3.x) trained unchanged: the recipe names its module, `verifiers_env: my_env` (and
`verifiers_env_args: {...}` for its `load_environment(**args)`), and the trainer runs the episodes verifiers'
rollout loop would, with verifiers' own objects doing the environment's part:

    verifiers                                   here
    env.dataset / env.eval_dataset              train_dataset / eval_dataset: verifiers' columns as it formats them
                                                (prompt with its system prompt, answer, info, task, example_id)
    env.tool_defs (ToolEnv's tools)             one tool per definition, its schema as verifiers built it
                                                (json_schema; a StatefulToolEnv's hidden arguments stay hidden)
    a tool call                                 env.env_response(messages, state) on an assistant message holding
                                                that call: ToolEnv's call_tool, a StatefulToolEnv's update_tool_args,
                                                error_formatter, stop_errors (-> state["error"], the episode ends)
    a turn without a tool call                  `respond`: the turn joins state["trajectory"]; the stop conditions
                                                (@vf.stop, or an older is_completed(messages, state)) end the
                                                episode; else env_response's messages are the reply, each with its
                                                role (user, system, tool; Reply.messages), and a final_env_response
                                                ends the episode after it (Reply.done)
    max_turns (model turns; <= 0: no limit)     max_env_steps = max_turns - 1 (the tool replies between max_turns
                                                model turns) and max_user_turns = max_turns (respond sees the last
                                                turn too, to record and score it, and replies nothing), unless the
                                                recipe sets fewer
    trajectory step "reward" set by the env     that turn's R_T (add_trajectory_step or env_response may set it), the
                                                final turn's too (a stop condition, max_turns: Reply(end=True))
    env.rubric (funcs, weights, parser)         one outcome reward per weighted function, named as it is, worth
                                                weight x score: rubric.score_rollout (score_group when it has group
                                                functions), on verifiers' named arguments (prompt, completion,
                                                answer, state, task, info, parser)

The messages verifiers code reads are dicts that also answer attribute access (`m["content"]`, `m.content`;
a tool call's `.name`, `.arguments` (JSON text), `.id`, and the OpenAI shape `["function"]["name"]`), so code
written for either of verifiers' message shapes reads them. See docs/guide.md, 'From verifiers' for what is not supported.
"""

import asyncio
import importlib
import inspect
import json
import logging
import os
import uuid
from typing import Callable

from mt_grpo.adapters import Adapted
from mt_grpo.compat import provide
from mt_grpo.base.registry import load_file

logger = logging.getLogger("mt_grpo")

FIELD = "verifiers_env"
# stop conditions the trainer enforces itself, from the settings this module derives (turn_limits)
TRAINER_STOPS = ("max_turns_reached",)


# ------------------------------------------------------------------------------------------------
# Loading the environment
# ------------------------------------------------------------------------------------------------
def adapt(args) -> Adapted:
    provide("verifiers")  # before the user's module imports: the installed verifiers, else the copy in mt_grpo/compat
    env = load_environment(args.verifiers_env, args.verifiers_env_args)
    episode = episode_class(env, os.path.splitext(os.path.basename(args.verifiers_env))[0])
    return Adapted(environment_factory=episode, outcome_funcs=rubric_rewards(env, episode),
                   train_dataset=_dataset(env, "dataset"), eval_dataset=_dataset(env, "eval_dataset"),
                   settings=turn_limits(env))


def load_environment(name: str, env_args: dict | None = None):
    """`load_environment(**env_args)` of the module `name`: an importable module (`my_env`, `pkg.my_env`, a
    verifiers id `my-env`) or a `.py` file; what it returns must be a classic verifiers environment."""
    if env_args is not None and not isinstance(env_args, dict):
        raise ValueError(f"`verifiers_env_args` is a {type(env_args).__name__}; give a mapping of load_environment's "
                         "keyword arguments, e.g. {num_train_examples: 100}.")
    module = _module(name)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"`verifiers_env: {name}`: module {module.__name__} ({getattr(module, '__file__', '?')}) has "
                         "no `load_environment` function. A verifiers environment module defines `def "
                         "load_environment(**kwargs) -> vf.Environment`; name that module.")
    try:
        env = load(**(env_args or {}))
    except TypeError as e:
        raise ValueError(f"`verifiers_env: {name}`: load_environment(**{env_args or {}}) failed: {e}. Fix "
                         f"`verifiers_env_args` to match its parameters {inspect.signature(load)}.") from e
    check_classic(env, name)
    return env


def _module(name: str):
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"`verifiers_env` is {name!r}; give the environment's module, e.g. `verifiers_env: "
                         "wordle` (its folder on PYTHONPATH, or installed with `pip install -e`).")
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise ValueError(f"`verifiers_env: {name}`: no such file ({os.path.abspath(name)}). Fix the path, or give "
                             "the module's name.")
        return load_file(name, os.path.splitext(os.path.basename(name))[0])  # under its own name, as an import
    candidates = [name, name.replace("-", "_")]  # verifiers' own load_environment maps an id's dashes so
    for candidate in dict.fromkeys(candidates):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if e.name not in (candidate, candidate.split(".")[0]):
                raise  # the module exists, and something it imports is missing: say that, not "no module"
    raise ValueError(f"`verifiers_env: {name}`: no module {' or '.join(dict.fromkeys(candidates))} to import. Put the "
                     "environment's folder on PYTHONPATH, install it (`pip install -e path/to/env`), or give the "
                     "path of its .py file.")


def check_classic(env, name: str) -> None:
    """A classic environment: env_response, a rubric, a dataset. verifiers.v1's agent environments and anything
    else fail naming what is supported."""
    cls = type(env)
    if cls.__module__.startswith("verifiers.v1") or not callable(getattr(env, "env_response", None)):
        raise ValueError(f"`verifiers_env: {name}`: load_environment returned a {cls.__module__}.{cls.__name__}, not a "
                         "classic verifiers environment (vf.ToolEnv, vf.StatefulToolEnv or a vf.MultiTurnEnv with "
                         "env_response; `verifiers.legacy` in verifiers 0.3). A verifiers.v1 environment runs an agent "
                         "program: train it as an `agent` through the endpoint (docs/guide.md, 'From an agent "
                         "program', 'verifiers v1').")
    if getattr(env, "rubric", None) is None:
        raise ValueError(f"`verifiers_env: {name}`: {cls.__name__} has no rubric; give it one "
                         "(`rubric=vf.Rubric(funcs=[...])`), the episodes' rewards.")
    if _dataset(env, "dataset") is None:
        raise ValueError(f"`verifiers_env: {name}`: {cls.__name__} has no train dataset (only an eval_dataset); give "
                         "load_environment a `dataset`, or train on the eval rows with `dataset_name`.")


def _dataset(env, which: str):
    """verifiers' formatted dataset (built now if the environment was given a builder)."""
    build = getattr(env, f"build_{which}", None)
    data = build() if callable(build) else getattr(env, which, None)
    return data if data is not None else getattr(env, which, None)


def turn_limits(env) -> dict:
    """verifiers' max_turns counts model turns; the trainer counts the replies between them: max_turns - 1 tool
    replies (max_env_steps); respond is asked after each of the max_turns turns (max_user_turns), the last one to
    record its trajectory step and score it, with no reply (VerifiersEpisode.respond). <= 0 is verifiers' no limit."""
    max_turns = getattr(env, "max_turns", -1)
    if not isinstance(max_turns, int) or max_turns <= 0:
        return {}
    return {"max_env_steps": max_turns - 1, "max_user_turns": max_turns}


# ------------------------------------------------------------------------------------------------
# Messages as verifiers code reads them
# ------------------------------------------------------------------------------------------------
class Message(dict):
    """A message (or tool call) as verifiers code reads it: a dict that also answers attribute access."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


def tool_call(call_id: str, name: str, arguments) -> Message:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return Message(id=call_id, type="function", name=name, arguments=text,
                   function=Message(name=name, arguments=text))


def vf_messages(messages: list[dict]) -> list[Message]:
    """The trainer's canonical messages (protocol.py) as verifiers messages: an assistant message's calls as
    tool calls with ids, each tool message with the id of the call it answers."""
    out, pending = [], []
    for k, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            calls = [tool_call(f"call_{k}_{j}", c["function"]["name"], c["function"].get("arguments", {}))
                     for j, c in enumerate(m.get("tool_calls") or [])]
            pending = [c.id for c in calls]
            out.append(Message(role="assistant", content=m.get("content") or "", tool_calls=calls or None))
        elif role == "tool":
            out.append(Message(role="tool", content=text(m), name=m.get("name", ""),
                               tool_call_id=pending.pop(0) if pending else f"call_{k}"))
        else:
            out.append(Message(role=role, content=m.get("content")))
    return out


def reply_message(message) -> dict:
    """One of env_response's messages as the trainer's reply message (user_turns.Reply.messages): its role and text,
    a tool message's name. An assistant message is refused there, naming the class and the fix."""
    get = message.get if isinstance(message, dict) else lambda k, d=None: getattr(message, k, d)
    role = get("role")
    role = "user" if role == "text" else role  # verifiers' TextMessage: a bare string's
    return {"role": role, "content": text(message), **({"name": get("name") or ""} if role == "tool" else {})}


def text(message) -> str:
    """A message's text, whether verifiers made it (a pydantic model) or a dict; a content list's text parts."""
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content)
    return "" if content is None else str(content)


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


async def call_named(func: Callable, **objects):
    """`func` called with the keyword arguments it names (all of them when it takes **kwargs), as verifiers calls
    stop conditions and reward functions."""
    params = inspect.signature(func).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        objects = {k: v for k, v in objects.items() if k in params}
    return await maybe_await(func(**objects))


def is_verifiers_error(e: Exception) -> bool:
    """verifiers' own errors (vf.Error: ToolCallError for a stop_errors exception, ...), which end a rollout."""
    return any(k.__name__ == "Error" and k.__module__.split(".")[0] == "verifiers" for k in type(e).__mro__)


# ------------------------------------------------------------------------------------------------
# The episode: one instance per episode, verifiers' state inside
# ------------------------------------------------------------------------------------------------
class VerifiersEpisode:
    """The environment_factory class of one verifiers environment (episode_class makes a subclass per
    environment, with its tools as methods). `state` is verifiers' rollout state."""

    vf_env = None  # the verifiers environment, shared by every episode (as verifiers shares it across rollouts)
    per_step_rewards = False  # the environment may set a trajectory step's reward (episode_class)

    def __init__(self):
        self.state, self.done = None, False
        if self.per_step_rewards:  # a tool turn's R_T: the rewards the environment set on its trajectory steps
            setattr(self, "step_rewards", [])  # not an assignment environments.has_step_rewards reads for every class

    async def reset(self, prompt: list[dict] | None = None, **row) -> None:
        env = self.vf_env
        self.done = False
        if self.per_step_rewards:
            setattr(self, "step_rewards", [])
        info = row.get("info", {})
        info = json.loads(info) if isinstance(info, str) and info else info or {}
        messages = vf_messages(prompt or [])
        self.state = {"input": {**row, "prompt": messages}, "prompt": messages, "completion": [],
                      "answer": row.get("answer", ""), "task": row.get("task", "default"), "info": info,
                      "example_id": row.get("example_id"), "trajectory": [], "trajectory_id": uuid.uuid4().hex,
                      "tool_defs": getattr(env, "tool_defs", None), "responses": [], "turn": 0, "reward": None,
                      "metrics": None, "error": None, "final_env_response": None, "is_completed": False,
                      "is_truncated": False}
        setup = getattr(env, "setup_state", None)
        if callable(setup):
            state = await maybe_await(setup(self.state))
            if isinstance(state, dict):  # verifiers 0.3's legacy setup_state returns the state
                self.state = state
        return None

    # -- a model turn: verifiers' trajectory step, its stop conditions, env_response --------------------
    async def _step(self, conversation: list[Message]) -> dict:
        """Record the model's last message as a trajectory step (add_trajectory_step: where an environment may set
        the step's reward)."""
        state = self.state
        state["completion"] = conversation[len(state["prompt"]):]
        state["turn"] += 1
        step = {"prompt": conversation[:-1], "completion": conversation[-1:], "response": None, "tokens": None,
                "reward": None, "advantage": None, "is_truncated": False,
                "trajectory_id": state["trajectory_id"], "extras": {}}
        add = getattr(self.vf_env, "add_trajectory_step", None)
        await maybe_await(add(state, step)) if callable(add) else state["trajectory"].append(step)
        return step

    async def _stopped(self, conversation: list[Message]) -> bool:
        """Whether verifiers' stop conditions end the episode after the model's last turn: the @vf.stop methods
        (but max_turns, which the trainer's limits enforce: turn_limits), or an older `is_completed(messages,
        state)`."""
        env, state = self.vf_env, self.state
        is_completed = getattr(env, "is_completed", None)
        if callable(is_completed) and "messages" in inspect.signature(is_completed).parameters:
            if await maybe_await(is_completed(conversation, state)):  # the older API's own check
                return True
        for condition in getattr(env, "_stop_conditions", None) or []:
            if condition.__name__ not in TRAINER_STOPS and await call_named(condition, state=state, env=env):
                state["is_completed"], state["stop_condition"] = True, condition.__name__
                return True
        return False

    async def _env_response(self, conversation: list[Message]) -> list:
        """env_response's messages (an older environment's `(messages, state)` pair too)."""
        out = await maybe_await(self.vf_env.env_response(conversation, self.state))
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out, self.state = out
        if isinstance(out, str):  # verifiers normalises a string to one message
            return [Message(role="user", content=out)] if out else []
        return [out] if isinstance(out, dict) else list(out or [])

    async def respond(self, messages: list[dict]):
        """A model turn without a tool call: verifiers' loop records it, checks its stop conditions, then replies
        with env_response as the user."""
        conversation = vf_messages(messages)
        step = await self._step(conversation)
        limit = getattr(self.vf_env, "max_turns", -1)
        if await self._stopped(conversation) or (isinstance(limit, int) and 0 < limit <= self.state["turn"]):
            score = step.get("reward")  # the episode ends on this turn, which keeps its score (gym's final step)
            return None if score is None else {"end": True, "score": float(score)}
        replies = await self._env_response(conversation)
        self.state["completion"] += replies
        score = step.get("reward")  # the reply's score: this turn's R_T
        final = self.state.get("final_env_response") is not None
        score = None if score is None else float(score)
        if not replies:  # nothing to append: the episode ends on this turn, which keeps its score
            return None if score is None else {"end": True, "score": score}
        return {"messages": [reply_message(m) for m in replies], "done": final, "score": score}

    async def _call(self, name: str, arguments: dict) -> str:
        """One tool call: env_response on the assistant message that holds it (ToolEnv's call_tool, a
        StatefulToolEnv's update_tool_args and hidden arguments, error_formatter, stop_errors)."""
        state = self.state
        conversation = state["prompt"] + state["completion"]
        call = tool_call(f"call_{len(conversation)}_0", name, arguments)
        conversation = conversation + [Message(role="assistant", content="", tool_calls=[call])]
        step = await self._step(conversation)
        try:
            replies = await self._env_response(conversation)
        except Exception as e:
            if not is_verifiers_error(e):
                raise
            state["error"], self.done = e, True  # verifiers ends the rollout on its own errors (has_error)
            cause = e.__cause__ or e
            return f"{type(cause).__name__}: {cause}"
        state["completion"] = conversation[len(state["prompt"]):] + replies
        if step.get("reward") is not None and self.per_step_rewards:
            self.step_rewards.append(float(step["reward"]))
        if await self._stopped(conversation + replies):
            self.done = True
        return "\n\n".join(text(m) for m in replies)


def episode_class(env, module_name: str | None = None) -> type:
    """The environment_factory class of `env`: VerifiersEpisode with one method per tool definition (its name,
    description and parameters as verifiers made them; a signature built from them, as tools/mcp.py builds one)."""
    from mt_grpo.tools.mcp import tool_signature

    methods = {}
    for tool in getattr(env, "tool_defs", None) or []:
        name, description, parameters = _tool_fields(tool)
        methods[name] = _tool_method(name, description, parameters, tool_signature(parameters))
    tools_only = bool(methods) and _inherits(env, "ToolEnv") and not _overrides(env, "no_tools_called")
    # a step's reward can only come from the environment's own env_response or add_trajectory_step
    per_step = bool(methods) and (_overrides(env, "env_response") or _overrides(env, "add_trajectory_step"))
    attributes = {"vf_env": env, "per_step_rewards": per_step, "tools_only": tools_only, **methods}
    if tools_only:  # a ToolEnv ends on a turn without a tool call (no_tools_called): nothing to reply
        attributes["respond"] = None
    # named after the environment's own class; a verifiers class used as is (vf.ToolEnv(...)) after its module
    own = type(env).__module__.split(".")[0] != "verifiers"
    name = type(env).__name__ if own else _identifier(getattr(env, "env_id", "") or module_name or type(env).__name__)
    cls = type(name, (VerifiersEpisode,), attributes)
    cls.__module__ = __name__
    return cls


def _identifier(name: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in name.rsplit(".", 1)[-1])
    return name if name.isidentifier() else f"env_{name}"


def _tool_fields(tool) -> tuple[str, str, dict]:
    """(name, description, parameters) of a vf.Tool, a {name, description, parameters} dict, or an older
    OpenAI-style {"type": "function", "function": {...}}."""
    get = (lambda k, d=None: tool.get(k, d)) if isinstance(tool, dict) else (lambda k, d=None: getattr(tool, k, d))
    if get("type") == "function" and get("function"):
        function = get("function")
        return function["name"], function.get("description", ""), function.get("parameters") or {}
    return get("name"), get("description", "") or "", dict(get("parameters") or {"type": "object", "properties": {}})


def _tool_method(name: str, description: str, parameters: dict, signature: inspect.Signature) -> Callable:
    keywords_only = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())

    async def method(self, *args, **kwargs):
        arguments = kwargs if keywords_only and not args else signature.bind(*args, **kwargs).arguments
        return await self._call(name, dict(arguments))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = description or name
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    method.__annotations__ = {**{p.name: p.annotation for p in signature.parameters.values()
                                 if p.annotation is not p.empty}, "return": str}
    method.json_schema = {"type": "function", "function": {"name": name, "description": description,
                                                           "parameters": parameters}}
    return method


def _inherits(env, base: str) -> bool:
    return any(k.__name__ == base for k in type(env).__mro__)


def _overrides(env, method: str) -> bool:
    """Whether the environment's own class (below verifiers' classes) defines `method`."""
    for klass in type(env).__mro__:
        if klass.__module__.split(".")[0] == "verifiers":
            return False
        if method in vars(klass):
            return True
    return False


# ------------------------------------------------------------------------------------------------
# The rubric
# ------------------------------------------------------------------------------------------------
def rubric_rewards(env, episode: type) -> list[Callable]:
    """One outcome reward per weighted rubric function: weight x its score, as verifiers sums them into the
    rollout's reward. Scoring runs once per episode (the first of these functions to be called scores the batch)."""
    rubric = env.rubric
    names = rubric._get_reward_func_names() if hasattr(rubric, "_get_reward_func_names") else \
        [f.__name__ for f in rubric.funcs]
    weights = rubric._get_reward_weights() if hasattr(rubric, "_get_reward_weights") else list(rubric.weights)
    funcs = [_rubric_reward(env, episode, name, weight) for name, weight in zip(names, weights) if weight != 0]
    if not funcs:
        raise ValueError(f"{type(env).__name__}'s rubric has no reward function with a weight other than 0 (only "
                         "metrics): add one, e.g. `vf.Rubric(funcs=[correct_answer], weights=[1.0])`.")
    return funcs


def _rubric_reward(env, episode: type, name: str, weight: float) -> Callable:
    def reward(prompts=None, completions=None, environments=None, **kwargs):
        states = score(env, episode, completions or [], environments or [])
        return [None if s is None else weight * float((s.get("metrics") or {}).get(name, 0.0)) for s in states]

    reward.__name__ = name
    return reward


def score(env, episode: type, completions: list, environments: list) -> list:
    """Each episode's verifiers state, scored by the rubric (None for another environment's episode): its
    completion as verifiers records it, then score_rollout, or score_group over the episodes of one example when
    the rubric has group functions."""
    from mt_grpo.base.runtime import run_async

    states, fresh = [], []
    for completion, instance in zip(completions, environments):
        state = instance.state if isinstance(instance, episode) else None
        if state is not None and state.get("reward") is None:
            conversation = state["prompt"] + vf_messages(completion or [])
            state["completion"] = conversation[len(state["prompt"]):]
            state["trajectory"] = trajectory(conversation, len(state["prompt"]), state)
            fresh.append(state)
        states.append(state)
    if fresh:
        run_async(_score(env.rubric, fresh))
    return states


def trajectory(conversation: list[Message], prompt_length: int, state: dict) -> list[dict]:
    """verifiers' trajectory of the whole episode: one step per model message, its reward as the episode set it."""
    live = [s.get("reward") for s in state.get("trajectory", [])]
    steps = []
    for k in range(prompt_length, len(conversation)):
        if conversation[k].get("role") == "assistant":
            steps.append({"prompt": conversation[:k], "completion": [conversation[k]], "response": None,
                          "tokens": None, "reward": live[len(steps)] if len(steps) < len(live) else None,
                          "advantage": None, "is_truncated": False, "trajectory_id": state.get("trajectory_id"),
                          "extras": {}})
    return steps


async def _score(rubric, states: list) -> None:
    if getattr(rubric, "has_group_rewards", False):
        groups: dict = {}
        for state in states:
            key = (str(state.get("example_id")), json.dumps(state.get("answer"), default=str))  # one example's group
            groups.setdefault(key, []).append(state)
        for group in groups.values():
            await rubric.score_group(group)
    else:
        await asyncio.gather(*[rubric.score_rollout(state) for state in states])
