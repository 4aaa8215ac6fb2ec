# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
"""Rubric (verifiers/rubrics/rubric.py): reward functions called with the named arguments they ask for."""

import asyncio
import inspect
import logging
from typing import get_origin

from .parsers import Parser
from .utils import maybe_await

logger = logging.getLogger("verifiers.rubrics.rubric")
GROUP_ARGUMENTS = {"states", "prompts", "completions", "answers", "tasks", "infos"}


class Rubric:
    """Each reward function takes any of prompt, completion, answer, state, task, info, parser (and **kwargs) and
    returns a float; the rollout's reward is the weighted sum. A function with plural arguments (prompts,
    completions, states, ...) or a list return scores a whole group."""

    def __init__(self, funcs: list | None = None, weights: list[float] | None = None, parser: Parser | None = None):
        self.funcs = funcs or []
        self.weights = weights or [1.0] * len(self.funcs)
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"Number of weights ({len(self.weights)}) must match number of functions "
                             f"({len(self.funcs)})")
        self.parser = parser or Parser()
        self.class_objects = {"parser": self.parser}

    def add_reward_func(self, func, weight: float = 1.0):
        self.funcs.append(func)
        self.weights.append(weight)

    def add_metric(self, func, weight: float = 0.0):
        self.funcs.append(func)
        self.weights.append(weight)

    def add_class_object(self, name: str, obj):
        self.class_objects[name] = obj

    def _get_reward_func_names(self) -> list[str]:
        return [getattr(f, "__name__", repr(f)) for f in self.funcs]

    def _get_reward_weights(self) -> list[float]:
        return self.weights

    def _is_group_func(self, func) -> bool:
        signature = inspect.signature(func)
        returns = signature.return_annotation
        return bool(set(signature.parameters) & GROUP_ARGUMENTS) or returns is list or get_origin(returns) is list

    @property
    def has_group_rewards(self) -> bool:
        return any(self._is_group_func(f) for f in self.funcs)

    def score_objects(self, state) -> dict:
        return {"prompt": state["prompt"], "completion": state["completion"], "answer": state.get("answer", ""),
                "state": state, "info": state.get("info", {}), "task": state.get("task"), **self.class_objects}

    async def _call(self, func, objects: dict, default):
        params = inspect.signature(func).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            objects = {k: v for k, v in objects.items() if k in params}
        try:
            return await maybe_await(func, **objects)
        except Exception as e:
            logger.error(f"Error calling reward function {func.__name__}: {e}")
            return default

    async def score_rollout(self, state):
        assert self.funcs and not self.has_group_rewards, \
            "Rubric.score_rollout requires at least one individual-level reward function and no group-level ones"
        scores = [float(await self._call(f, self.score_objects(state), 0.0)) for f in self.funcs]
        state["metrics"] = {f.__name__: s for f, s in zip(self.funcs, scores)}
        state["reward"] = sum(s * w for s, w in zip(scores, self.weights))

    async def score_group(self, states: list):
        rewards = [0.0] * len(states)
        metrics = {}
        for func, weight in zip(self.funcs, self.weights):
            if self._is_group_func(func):
                objects = {"prompts": [s["prompt"] for s in states], "completions": [s["completion"] for s in states],
                           "answers": [s.get("answer", "") for s in states], "states": states,
                           "tasks": [s.get("task") for s in states], "infos": [s.get("info", {}) for s in states],
                           **self.class_objects}
                scores = await self._call(func, objects, [0.0] * len(states))
            else:
                scores = await asyncio.gather(*[self._call(func, self.score_objects(s), 0.0) for s in states])
            metrics[func.__name__] = [float(x) for x in scores]
            rewards = [r + float(x) * weight for r, x in zip(rewards, scores)]
        mean = sum(rewards) / len(states)
        for i, state in enumerate(states):
            state["reward"], state["advantage"] = rewards[i], rewards[i] - mean
            state["metrics"] = {name: values[i] for name, values in metrics.items()}
