# Copyright 2025 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License"); see mt_grpo/compat/verl/LICENSE.
# Abridged from verl 0.7.1's verl/utils/rollout_trace.py: its rollout tracer (weave / mlflow traces of each tool call) imports verl.utils.ray_utils (ray);
# the tools here only use its decorator, which is a no-op when no tracing backend is configured, as here.
import functools
import inspect


def rollout_trace_op(func):
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(self, *args, **kwargs):
            return await func(self, *args, **kwargs)

        return async_wrapper

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        return func(self, *args, **kwargs)

    return wrapper
