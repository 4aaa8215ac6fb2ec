# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
import inspect


async def maybe_await(func, *args, **kwargs):
    result = func(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def maybe_call_with_named_args(func, **kwargs):
    """Call `func` with the keyword arguments its signature names (all of them if it takes **kwargs)."""
    params = inspect.signature(func).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return await maybe_await(func, **kwargs)


def convert_func_to_tool_def(func):
    """The vf.Tool of a Python function: name, description and JSON-schema parameters from its signature and
    Google-style docstring."""
    from transformers.utils import get_json_schema

    from .types import Tool

    schema = get_json_schema(func)["function"]
    return Tool(name=func.__name__, description=schema.get("description", ""),
                parameters=schema.get("parameters", {"type": "object", "properties": {}}))
