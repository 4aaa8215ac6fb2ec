"""Reward functions, by name.

A reward function is `fn(prompts, completions, **dataset_columns)`; `completions[i]` is the
canonical conversation of protocol.py (rewards/conversation.py reads it). It returns one of two forms:

    per sample (default)   list[float | None]: one value per sample; None = "not applicable".
                           Every outcome reward, and the turn rewards that judge the whole episode
                           or its first tool turn.
    per turn (@per_turn)   list[list[float | None]]: for each sample, the value of each of its tool
                           turns in order, `len(values[i]) == count_tool_turns(completions[i])`
                           ([] for a sample without a tool turn). Turn rewards only.

The `per_turn` decorator marks the second form (`fn.per_turn = True`; test it with `is_per_turn`):
the trainer reads the mark and never guesses the form from the values. `tool_turns(completion)`
gives each tool turn as (assistant message, [the tool messages that answer it]), for the trainer
and the rewards alike.

To add a reward: write the function in a module under `rewards/`, then either add it to
`REWARD_FUNCS` below and use its name in the recipe's `turn_reward_funcs` / `outcome_reward_funcs`
lists, or put its dotted path there (`rewards.my_module:my_reward`, or any importable module).

    @per_turn
    def short_calls(prompts, completions, **kwargs):  # 0.1 for each tool turn under 300 characters
        return [[0.1 if len(content(m)) < 300 else 0.0 for m, _ in tool_turns(c)] for c in completions]
"""

import importlib
from typing import Callable

from rewards.conversation import count_tool_turns, is_per_turn, per_turn, tool_turns
from rewards.triviaqa_reward import OUTCOME_REWARD_FUNCS, TURN_REWARD_FUNCS

__all__ = ["REWARD_FUNCS", "get_reward_func", "per_turn", "is_per_turn", "tool_turns", "count_tool_turns"]

REWARD_FUNCS: dict[str, Callable] = {fn.__name__: fn for fn in TURN_REWARD_FUNCS + OUTCOME_REWARD_FUNCS}


def get_reward_func(name: str) -> Callable:
    """A registry name, or a dotted path to any importable function: `package.module:func` or
    `package.module.func`. Fails with a ValueError that says what to change."""
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if ":" not in name and "." not in name:
        raise ValueError(f"Unknown reward function '{name}'. Valid names: {', '.join(sorted(REWARD_FUNCS))}; "
                         "a dotted path `module:function` to any importable function also works.")
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"Reward function path '{name}' must look like `module:function` or `module.function`.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while it loads
        raise ValueError(f"Reward function '{name}': cannot import module '{module_name}' "
                         f"({type(e).__name__}: {e}).") from e
    if not hasattr(module, attr):
        raise ValueError(f"Reward function '{name}': module '{module_name}' has no attribute '{attr}'.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"Reward function '{name}': '{attr}' in '{module_name}' is a {type(fn).__name__}, "
                         "not a function.")
    return fn
