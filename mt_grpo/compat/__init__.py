"""Copies of other frameworks' base classes, shipped so that an environment written for verl, classic verifiers or
OpenEnv (`from verl.tools.base_tool import BaseTool`, `import verifiers as vf`, `from openenv.core.env_server.
interfaces import Environment`) trains here without installing that framework, whose own package does not import
without its heavy dependencies (ray and tensordict; openai, anthropic and prime-sandboxes; fastapi and fastmcp).
What is copied from where, under which license: README.md beside this file.

    mt_grpo/compat/verl/verl/             verl 0.7.1 (Apache-2.0)
    mt_grpo/compat/verifiers/verifiers/   verifiers 0.1.14's classic classes (MIT)
    mt_grpo/compat/openenv/openenv/       openenv 0.10.0 / openenv-core 0.3.0's core types (BSD-3-Clause)

Each adapter calls `provide(framework)` before it imports the user's code: when the real package's modules import,
nothing changes (an installed framework always wins); when they do not, that framework's folder goes first on
sys.path (and in PYTHONPATH, for the processes the run starts), so the user's `import verl...` finds the copy.
"""

import importlib
import logging
import os
import sys

logger = logging.getLogger("mt_grpo")

HERE = os.path.dirname(os.path.abspath(__file__))
# framework -> (the version copied, the modules an environment imports, `module:name` where the module must hold that
# name: the real package must provide them all (verifiers 0.3 on has no classic classes, only verifiers.v1), what the
# copy covers, in words)
COPIES = {
    "verl": ("0.7.1", ("verl.tools.base_tool", "verl.tools.schemas", "verl.interactions.base",
                       "verl.utils.reward_score"), "tool, interaction, reward_score"),
    "verifiers": ("0.1.14", ("verifiers:MultiTurnEnv",), "its classic environments, parsers and rubric"),
    "openenv": ("0.10.0", ("openenv.core.env_server.interfaces", "openenv.core.env_server.types"),
                "Environment, Action, Observation, State"),
}
_USED: dict[str, bool] = {}  # framework -> whether the copy is in use (decided once per process)


def provide(framework: str) -> bool:
    """Make `framework` importable: the installed package if its modules import, else the copy. True when the copy
    is used."""
    if framework in _USED:
        return _USED[framework]
    version, modules, covers = COPIES[framework]
    try:
        for entry in modules:
            module, _, name = entry.partition(":")
            if not hasattr(importlib.import_module(module), name or "__name__"):
                raise ImportError(f"{module} has no {name}")  # installed, but not the API the copy stands for
        _USED[framework] = False
        return False
    except ImportError as e:  # ModuleNotFoundError too: not installed, or installed without its dependencies
        why = "not installed" if isinstance(e, ModuleNotFoundError) and e.name == framework else \
            f"installed without what the copy stands for ({e})" if "has no" in str(e) else \
            f"installed but does not import here ({type(e).__name__}: {e})"
    # a failed import can leave the real package's parents in sys.modules: drop them, so the copy is found whole
    for name in [n for n in sys.modules if n == framework or n.startswith(framework + ".")]:
        del sys.modules[name]
    folder = os.path.join(HERE, framework)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder] + [p for p in paths if p])
    importlib.invalidate_caches()
    logger.warning("%s is %s: using the copy of %s %s's base classes in mt_grpo/compat (%s).", framework, why,
                   framework, version, covers)
    _USED[framework] = True
    return True


def provide_for(module_name: str) -> bool:
    """`provide` the framework a module's dotted name starts with (`verl.utils.reward_score`), if it is one with a
    copy here. True when the copy is in use."""
    top = module_name.split(".", 1)[0]
    return top in COPIES and provide(top)
