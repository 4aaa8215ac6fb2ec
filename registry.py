"""From a name in a recipe to a function: the one lookup behind rewards (rewards/) and tools (tools/).

A recipe names a function in one of two ways:

    registry name   a key of the package's registry: `REWARD_FUNCS` in rewards/, `TOOLS` in tools/
    dotted path     any importable function: `package.module:function`, or `package.module.function`
    file path       a function of a Python file: `path/to/file.py:function` (verl's custom_reward_function
                    `path` and `name`)

A registry entry is the function itself, or its dotted path as a string: that module is imported only
when a recipe names the entry. Every failure is a ValueError that says what to change; an unknown name
lists the valid ones.
"""

import importlib
from typing import Callable


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


# Each is called with a module's name before it is imported, and with a missing module's name when an import fails;
# True when it made the module importable (adapters/compat registers its copies of verl, verifiers and OpenEnv).
IMPORT_HELPERS: list[Callable[[str], bool]] = []


def _import(module_name: str):
    """The module at `module_name` (a dotted name, or a .py file). One that needs verl, verifiers or OpenEnv where
    the framework is not installed (`verl.utils.reward_score`, or a user's module that imports it) gets the
    framework's copy (IMPORT_HELPERS), and is imported once more."""
    load = load_file if module_name.endswith(".py") else importlib.import_module
    if not module_name.endswith(".py"):
        for helper in IMPORT_HELPERS:
            helper(module_name)
    try:
        return load(module_name)
    except ModuleNotFoundError as e:
        if not any([helper(e.name or "") for helper in IMPORT_HELPERS]):
            raise
        return load(module_name)


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
