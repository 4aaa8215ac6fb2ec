# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
import inspect
from typing import Any


def discover_decorated(obj: Any, attr: str) -> list:
    """Bound methods of `obj` marked with `attr`, by descending `{attr}_priority`, then name."""
    methods = [m for _, m in inspect.getmembers(obj, predicate=inspect.ismethod) if hasattr(m, attr)]
    methods.sort(key=lambda m: (-getattr(m, f"{attr}_priority", 0), m.__name__))
    return methods


def _mark(attr: str, func=None, priority: int = 0):
    def decorator(f):
        setattr(f, attr, True)
        setattr(f, f"{attr}_priority", priority)
        return f

    return decorator if func is None else decorator(func)


def stop(func=None, priority: int = 0):
    """Mark a method as a stop condition: `(self, state) -> bool`, checked by is_completed."""
    return _mark("stop", func, priority)


def cleanup(func=None, priority: int = 0):
    """Mark a method as a rollout cleanup handler."""
    return _mark("cleanup", func, priority)
