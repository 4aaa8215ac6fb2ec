"""Reward functions, by name.

To add a reward: write `fn(prompts, completions, **dataset_columns) -> list[float | None]` (one value
per sample; None = "not applicable") in a module under `rewards/`, then either add it to
`REWARD_FUNCS` below and use its name in the recipe's `turn_reward_funcs` / `outcome_reward_funcs`
lists, or put its dotted path there (`rewards.my_module:my_reward`, or any importable module).
"""

import importlib
from typing import Callable

from rewards.triviaqa_reward import OUTCOME_REWARD_FUNCS, TURN_REWARD_FUNCS

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
