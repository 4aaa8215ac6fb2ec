"""From a name in a recipe to a function: the one lookup behind rewards (mt_grpo/rewards/) and tools (mt_grpo/tools/).

A recipe names a function in one of two ways:

    registry name   a key of the package's registry: `REWARD_FUNCS` in mt_grpo/rewards/, `TOOLS` in mt_grpo/tools/
    dotted path     any importable function: `package.module:function`, or `package.module.function`
    file path       a function of a Python file: `path/to/file.py:function` (verl's custom_reward_function
                    `path` and `name`)

A registry entry is the function itself, or its dotted path as a string: that module is imported only
when a recipe names the entry. Every failure is a ValueError that says what to change; an unknown name
lists the valid ones.
"""

import importlib
import logging
from typing import Callable

from mt_grpo.compat import provide_for

logger = logging.getLogger("mt_grpo")


def resolve(name: str, registry: dict[str, Callable | str], kind: str) -> Callable:
    """The function `name` stands for: `registry[name]`, or the function at the dotted path `name`.
    `kind` ("reward function", "tool") is what the error messages call it."""
    entry = registry.get(name, name)
    if callable(entry):
        return entry
    if ":" not in entry and "." not in entry:
        raise ValueError(f"Unknown {kind} '{name}'. Valid names: {', '.join(sorted(registry))}; "
                         "a dotted path `module:function` to any importable function also works.")
    what = f"{kind[0].upper()}{kind[1:]} '{name}'"
    module_name, _, attr = entry.partition(":") if ":" in entry else entry.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what}: the path '{entry}' must look like `module:function` or `module.function`.")
    try:
        module = _import(module_name)
    except FileNotFoundError:
        raise ValueError(f"{what}: there is no file '{module_name}' (a path is relative to the directory the trainer "
                         "runs in).") from None
    except Exception as e:  # ImportError, or whatever the module raises while it loads
        raise ValueError(f"{what}: cannot import module '{module_name}' ({type(e).__name__}: {e}).") from e
    if not hasattr(module, attr):
        raise ValueError(f"{what}: module '{module_name}' has no attribute '{attr}'.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"{what}: '{attr}' in '{module_name}' is a {type(fn).__name__}, not a function.")
    return fn


# The modules that stood at the repository's top level before the package: a recipe's dotted path from then
# (`rewards.triviaqa_reward:f`, `tools.search:make_search_tool`, `tasks.textworld_quest:TextWorldQuest`) resolves to
# the module's place in mt_grpo/, with a warning naming it, where no module of that name is importable (a user's own
# `rewards.py` or `tools/` wins).
MOVED = {"rewards": "mt_grpo.rewards", "tools": "mt_grpo.tools", "tasks": "mt_grpo.tasks",
         "adapters": "mt_grpo.adapters", "protocol": "mt_grpo.base.protocol", "fields": "mt_grpo.base.fields",
         "registry": "mt_grpo.base.registry", "completions": "mt_grpo.base.completions",
         "turn_samples": "mt_grpo.base.turn_samples", "sampling": "mt_grpo.engine.sampling",
         "packing": "mt_grpo.engine.packing", "weight_sync": "mt_grpo.engine.weight_sync",
         "server_pool": "mt_grpo.engine.server_pool", "episodes": "mt_grpo.rollout.episodes",
         "user_turns": "mt_grpo.rollout.user_turns", "environments": "mt_grpo.rollout.environments",
         "scheduling": "mt_grpo.rollout.scheduling", "builders": "mt_grpo.run.builders",
         "checks": "mt_grpo.run.checks", "reporting": "mt_grpo.run.reporting", "evaluation": "mt_grpo.run.evaluation",
         "async_rollout": "mt_grpo.rollout.async_rollout", "dynamic_sampling": "mt_grpo.rollout.dynamic_sampling",
         "adapters.compat": "mt_grpo.compat"}
_WARNED: set[str] = set()


def moved_to(module_name: str) -> str | None:
    """The package's name of a module that stood at the top level before (`rewards.answers` ->
    `mt_grpo.rewards.answers`); None for any other name."""
    old = max((name for name in MOVED if module_name == name or module_name.startswith(name + ".")), key=len,
              default=None)  # the longest: adapters.compat before adapters
    return None if old is None else MOVED[old] + module_name[len(old):]


def _import(module_name: str):
    """The module at `module_name` (a dotted name, or a .py file). One that needs verl, verifiers or OpenEnv where
    the framework is not installed (`verl.utils.reward_score`, or a user's module that imports it) gets the
    framework's copy (mt_grpo/compat), and is imported once more; an old top-level name of ours, its new one."""
    if module_name.endswith(".py"):
        return load_file(module_name)
    provide_for(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if provide_for(e.name or ""):
            return importlib.import_module(module_name)
        new = moved_to(module_name)
        missing = e.name or ""
        if new is None or not (module_name == missing or module_name.startswith(missing + ".")):
            raise  # the module was found and itself imports something missing: its own error
        module = importlib.import_module(new)
        if module_name not in _WARNED:
            _WARNED.add(module_name)
            logger.warning("`%s` is now `%s` (mt_grpo/): it is used; write the new path in the recipe.", module_name,
                           new)
        return module


def load_file(path: str, name: str | None = None):
    """The module of the Python file at `path`, loaded once, under `name` (None: its own, `file:<absolute path>`) so
    that pickling and a second lookup find it; a module of that name from another file is not taken for it."""
    import os
    import sys
    import importlib.util

    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    full = os.path.abspath(path)
    name = name or "file:" + full
    existing = sys.modules.get(name)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == full:
        return existing
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
