"""Environments written for other frameworks, trained here unchanged: each adapter is a module of this package that
turns the framework's own objects (verl's tool and interaction configs, an ms-swift scheduler, a verifiers
environment, an OpenEnv environment) into what the trainer already runs: an `environment_factory` class (TRL's
contract with this project's extensions: `respond` for user turns, `done`, `step_rewards`, `end_episode`;
environments.py), reward functions, and a dataset or its defaults. No wrapper code from the user: one recipe field
(or constructor keyword) names the framework's object.

    recipe field              module         what it names
    verl_tool_config          verl.py        verl's tools YAML (`tools: [{class_name, config, tool_schema}]`)
    verl_interaction_config   verl.py        verl's interaction YAML (`interaction: [{name, class_name, config}]`)
    verl_max_assistant_turns  verl.py        verl's `multi_turn.max_assistant_turns`, with either config
    multi_turn_scheduler      swift.py       an ms-swift MultiTurnScheduler: `plugin.py:Class` or `module:Class`
    external_plugins          swift.py       ms-swift plugin files (their `multi_turns` and `orms` registrations)
    verifiers_env             verifiers.py   a classic verifiers environment: `module` (its load_environment)
    openenv_env               openenv.py     an OpenEnv Environment `module:Class`, or its server's URL (ws://, http://)

`adapt(args, parts)` runs in builders.assemble: each adapter the config names returns an `Adapted`, merged there.
`resolve_reward(name or function)` is the run's reward lookup (builders.py): rewards.get_reward_func, with the reward
names another framework registers (ms-swift plugins' `orms`) and the frameworks' reward forms (an ms-swift ORM, verl's
compute_score) adapted. Importing this package changes no other module.
The frameworks need not be installed: mt_grpo/compat ships copies of verl's, verifiers' and OpenEnv's base classes,
which each adapter puts on sys.path before it imports the user's code, when the framework itself does not import.
"""

import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable

from mt_grpo.base.fields import arg
from mt_grpo.rewards import get_reward_func


@dataclass
class AdapterArguments:
    """The recipe keys that name another framework's environment (adapters/); the trainer's config inherits them."""

    verl_tool_config: str | None = arg(None, "verl's tools YAML (`tools_config_file`): native BaseTool classes and MCP "
                                       "tools, each its own `tool_schema` (docs/guide.md, 'From verl').")
    verl_interaction_config: str | None = arg(None, "verl's interaction YAML (`interaction_config_path`): user turns "
                                              "from `generate_response`, picked per row by `interaction_kwargs.name`.")
    verl_max_assistant_turns: int | None = arg(None, "verl's `multi_turn.max_assistant_turns`: the model turns an "
                                               "episode may take (None: no limit). The turn that reaches it ends the "
                                               "episode, no call run nor reply asked (stop reason max_assistant_turns); "
                                               "max_env_steps becomes one less (docs/guide.md, 'From verl').",
                                               minimum=1)
    multi_turn_scheduler: str | None = arg(None, "An ms-swift MultiTurnScheduler: `plugin.py:Class`, `module:Class`, "
                                           "or a name in swift's `multi_turns` registry (docs/guide.md, 'From "
                                           "ms-swift').")
    external_plugins: list[str] | None = arg(None, "ms-swift plugin files imported at start-up, as swift's "
                                             "`--external_plugins`: what they register in `multi_turns` and `orms` "
                                             "can be named by `multi_turn_scheduler` and the reward lists.")
    swift_max_turns: int | None = arg(None, "multi_turn_scheduler: swift's `--max_turns`, the model turns an episode "
                                      "may take (each continuation counts; None: no limit but the scheduler's own and "
                                      "the token budget). Given to the scheduler as `max_turns`.", minimum=1)
    verifiers_env: str | None = arg(None, "A classic verifiers environment: the module whose `load_environment` "
                                    "returns a ToolEnv, StatefulToolEnv or MultiTurnEnv (docs/guide.md, 'From "
                                    "verifiers').")
    verifiers_env_args: dict | None = arg(None, "Keyword arguments of `load_environment` (verifiers_env).")
    openenv_env: str | None = arg(None, "An OpenEnv Environment `module:Class`, or its server's URL: `ws://host:port` "
                                  "(sessions) or `http://host:port` (docs/guide.md, 'From OpenEnv').")
    openenv_action: str | None = arg(None, "openenv_env: its Action class `module:Class` (None: found from the "
                                     "environment's `step` signature).")


@dataclass
class Adapted:
    """What an adapter adds to a run (builders.assemble merges it; None and [] add nothing)."""

    environment_factory: Callable | dict | None = None  # environments.py's contract, with the extensions
    outcome_funcs: list[Callable] = field(default_factory=list)  # outcome rewards, weight 1
    turn_funcs: list[Callable] = field(default_factory=list)  # @per_tool_turn rewards, weight 1
    train_dataset: object = None  # a datasets.Dataset, when the framework brings its own (verifiers)
    read_dataset_name: bool = False  # train_dataset is the recipe's dataset_name, read in the framework's format
    eval_dataset: object = None
    system_prompt: str | None = None  # the framework's system prompt, when it brings one
    tools: list[Callable] = field(default_factory=list)  # stateless tools (MCP servers)
    use_tokenizer: Callable | None = None  # called with the run's tokenizer once it is loaded (after adapt)
    # the environment draws its game from reset's `seed`: a row without one gets its own (builders.seed_rows), so
    # the G episodes of a row, one group, play one game (OpenEnv)
    group_seeds: bool = False
    # config fields the framework's environment fixes (verifiers' max_turns: max_env_steps, max_user_turns): set
    # where the config leaves them None; where it sets one, the smaller value holds (builders.apply_settings)
    settings: dict = field(default_factory=dict)


ADAPTERS = {  # recipe field -> the module whose `adapt(args)` reads it
    "verl_tool_config": "mt_grpo.adapters.verl", "verl_interaction_config": "mt_grpo.adapters.verl",
    "verl_max_assistant_turns": "mt_grpo.adapters.verl",
    "multi_turn_scheduler": "mt_grpo.adapters.swift", "external_plugins": "mt_grpo.adapters.swift",
    "swift_max_turns": "mt_grpo.adapters.swift",
    "verifiers_env": "mt_grpo.adapters.verifiers", "openenv_env": "mt_grpo.adapters.openenv",
}


REQUIRES = {"verifiers_env_args": "verifiers_env", "openenv_action": "openenv_env",  # a field -> the one it completes
            "swift_max_turns": "multi_turn_scheduler"}


def adapt(args) -> list[Adapted]:
    """What each adapter named by the config adds (one call per module, however many of its fields are set)."""
    import importlib

    for name, needed in REQUIRES.items():
        if getattr(args, name, None) is not None and getattr(args, needed, None) is None:
            raise ValueError(f"`{name}` is set but `{needed}` is not: `{name}` completes `{needed}`; set `{needed}` "
                             f"too, or remove `{name}`.")
    modules = dict.fromkeys(module for name, module in ADAPTERS.items() if getattr(args, name, None) is not None)
    return [importlib.import_module(module).adapt(args) for module in modules]


def fields_set(args) -> list[str]:
    return [f.name for f in dataclasses.fields(AdapterArguments) if getattr(args, f.name, None) is not None]


def swift_form(fn: Callable) -> Callable:
    """An ms-swift ORM reward (a class deriving from swift's ORM, or whose __call__ takes `completions` first; or an
    instance of one) as a function of ours: swift's keywords, completions as text (adapters/swift.py)."""
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    from mt_grpo.adapters.swift import is_swift_reward, swift_reward

    return swift_reward(fn) if is_swift_reward(fn) else fn


def verl_form(fn: Callable) -> Callable:
    """A verl compute_score as a function of ours (adapters/verl.py); any other function as is."""
    from mt_grpo.adapters.verl import is_verl_reward, verl_reward

    return verl_reward(fn) if is_verl_reward(fn) else fn


# Other frameworks' reward forms: each takes a function and gives it back in this trainer's form, or as it is when the
# form is not its own. swift's first: a class is unwrapped before verl's check.
REWARD_FORMS = (swift_form, verl_form)


def resolve_reward(reward: str | Callable) -> Callable:
    """A recipe's reward as this trainer calls it: a name or a dotted path (rewards.get_reward_func), else a name that
    ms-swift's `orms` registry holds (its built-ins, or a plugin's: a run with `multi_turn_scheduler` or
    `external_plugins`); a function, or what a name stands for, in another framework's form adapted (REWARD_FORMS).
    An unknown name fails with rewards' error, which lists the valid names."""
    if isinstance(reward, str):
        try:
            reward = get_reward_func(reward)
        except ValueError:
            swift = sys.modules.get("mt_grpo.adapters.swift")  # loaded by a run that names ms-swift's objects
            found = swift.lookup_reward(reward) if swift is not None else None
            if found is None:
                raise
            return found  # already in our form (swift.swift_reward)
    for form in REWARD_FORMS:
        reward = form(reward)
    return reward
