# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
"""Environment, MultiTurnEnv, ToolEnv and StatefulToolEnv (verifiers/envs/), without the rollout loop: what an
environment module defines and the trainer calls (datasets, tool_defs, stop conditions, env_response)."""

import inspect
import json
import logging
from abc import ABC, abstractmethod
from typing import Callable

from .decorators import discover_decorated, stop
from .errors import Error, ToolCallError, ToolParseError
from .parsers import Parser
from .rubric import Rubric
from .types import Tool, ToolMessage
from .utils import convert_func_to_tool_def, maybe_await, maybe_call_with_named_args


class Environment(ABC):
    def __init__(self, dataset=None, eval_dataset=None, system_prompt: str | None = None, few_shot=None,
                 parser: Parser | None = None, rubric: Rubric | None = None, sampling_args: dict | None = None,
                 tool_defs: list | None = None, max_workers: int = 512, env_id: str | None = None,
                 env_args: dict | None = None, map_kwargs: dict = {}, max_seq_len: int | None = None, **kwargs):
        self.logger = logging.getLogger(f"verifiers.envs.{type(self).__name__}")
        self.tool_defs = [t if isinstance(t, Tool) else Tool.model_validate(t) for t in tool_defs] \
            if tool_defs is not None else None
        self.system_prompt, self.few_shot = system_prompt, few_shot
        self.parser = parser or Parser()
        self.rubric = rubric or Rubric()
        self.env_id, self.env_args, self.map_kwargs, self.max_seq_len = env_id or "", env_args or {}, map_kwargs, \
            max_seq_len
        self.sampling_args = {"n": 1, "extra_body": {}, **(sampling_args or {})}
        for key, value in kwargs.items():
            setattr(self, key, value)
        if dataset is None and eval_dataset is None:
            raise ValueError("Either dataset or eval_dataset must be provided")
        self.dataset_source = dataset if callable(dataset) else (lambda ds=dataset: ds) if dataset is not None else None
        self.eval_dataset_source = eval_dataset if callable(eval_dataset) else \
            (lambda ds=eval_dataset: ds) if eval_dataset is not None else None
        self.dataset = self.eval_dataset = None
        if dataset is not None and not callable(dataset):
            self.build_dataset()
        if eval_dataset is not None and not callable(eval_dataset):
            self.build_eval_dataset()
        self._stop_conditions = discover_decorated(self, "stop")
        self._cleanup_handlers = discover_decorated(self, "cleanup")

    def _format_dataset(self, dataset, system_prompt=None, few_shot=None, question_key="question",
                        answer_key="answer"):
        """example_id, and a `prompt` column of chat messages: [system?, *few_shot, user question]; a dataset that
        has `prompt` gets the system prompt prepended unless its first message is a system one."""
        if "example_id" not in dataset.column_names:
            dataset = dataset.add_column("example_id", list(range(len(dataset))))
        if "prompt" not in dataset.column_names:
            def prompt_of(question):
                return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                    list(few_shot or []) + [{"role": "user", "content": question}]

            return dataset.map(lambda x: {"prompt": prompt_of(x[question_key])}, **self.map_kwargs)
        if system_prompt is not None:
            dataset = dataset.map(lambda x: {"prompt": x["prompt"] if x["prompt"] and x["prompt"][0]["role"] == "system"
                                             else [{"role": "system", "content": system_prompt}, *x["prompt"]]},
                                  **self.map_kwargs)
        return dataset

    def build_dataset(self):
        if self.dataset is None and self.dataset_source is not None:
            self.dataset = self._format_dataset(self.dataset_source(), self.system_prompt, self.few_shot)
        return self.dataset

    def build_eval_dataset(self):
        if self.eval_dataset is None and self.eval_dataset_source is not None:
            self.eval_dataset = self._format_dataset(self.eval_dataset_source(), self.system_prompt, self.few_shot)
        return self.eval_dataset

    def get_dataset(self, n: int = -1, seed: int | None = None):
        dataset = self.build_dataset()
        if dataset is None:
            raise ValueError("dataset is not set")
        return dataset.select(range(min(n, len(dataset)))) if n > 0 else dataset

    def get_eval_dataset(self, n: int = -1, seed: int | None = None):
        dataset = self.build_eval_dataset()
        return self.get_dataset(n, seed) if dataset is None else \
            dataset.select(range(min(n, len(dataset)))) if n > 0 else dataset

    async def is_completed(self, state, **kwargs) -> bool:
        """Check the stop conditions; the first that fires names state["stop_condition"]."""
        for condition in self._stop_conditions:
            if await maybe_call_with_named_args(condition, state=state, env=self, **kwargs):
                state["is_completed"], state["stop_condition"] = True, condition.__name__
                return True
        return False

    async def cleanup(self, state, task=None, resources=None):
        for handler in self._cleanup_handlers:
            await maybe_call_with_named_args(handler, task=task, state=state, env=self, resources=resources)


class MultiTurnEnv(Environment):
    def __init__(self, max_turns: int = -1, timeout_seconds: float | None = None, **kwargs):
        super().__init__(**kwargs)
        self.max_turns = max_turns
        self.timeout_seconds = timeout_seconds

    @abstractmethod
    async def env_response(self, messages, state, **kwargs):
        """The environment's reply messages to the model's last turn."""

    @stop(priority=100)
    async def has_error(self, state, **kwargs) -> bool:
        return state.get("error") is not None

    @stop
    async def max_turns_reached(self, state) -> bool:
        return len(state["trajectory"]) >= self.max_turns and self.max_turns > 0

    @stop
    async def has_final_env_response(self, state) -> bool:
        return state.get("final_env_response") is not None

    async def setup_state(self, state) -> None:
        """Override to add environment-specific state fields. Mutate state in place."""

    async def add_trajectory_step(self, state, trajectory_step):
        """Override to set intermediate rewards, advantages, or extra metadata."""
        state["trajectory"].append(trajectory_step)


class ToolEnv(MultiTurnEnv):
    def __init__(self, tools: list[Callable] | None = None, max_turns: int = 10,
                 error_formatter: Callable[[Exception], str] = lambda e: f"{e}", stop_errors: list | None = None,
                 **kwargs):
        self.tools = tools or []
        self.max_turns = max_turns
        self.error_formatter = error_formatter
        self.stop_errors = stop_errors or []
        self.tool_defs = [convert_func_to_tool_def(tool) for tool in self.tools]
        self.tool_map = {getattr(tool, "__name__", tool.__class__.__name__): tool for tool in self.tools}
        super().__init__(tool_defs=self.tool_defs, max_turns=max_turns, **kwargs)

    def _should_stop_for_error(self, err: Exception) -> bool:
        return any(isinstance(err, t) for t in self.stop_errors)

    def add_tool(self, tool: Callable):
        self.tools.append(tool)
        self.tool_defs.append(convert_func_to_tool_def(tool))
        self.tool_map[getattr(tool, "__name__", tool.__class__.__name__)] = tool

    @stop
    async def no_tools_called(self, state) -> bool:
        if len(state["trajectory"]) == 0:
            return False
        last = state["trajectory"][-1]["completion"][-1]
        return last.get("role") == "assistant" and not last.get("tool_calls")

    async def call_tool(self, tool_name: str, tool_args: dict, tool_call_id: str, **kwargs) -> ToolMessage:
        result = await maybe_await(self.tool_map[tool_name], **tool_args)
        return ToolMessage(role="tool", content=str(result), tool_call_id=tool_call_id)

    async def env_response(self, messages, state, **kwargs):
        tool_messages = []
        for tool_call in messages[-1].tool_calls:
            try:
                tool_name, tool_args = tool_call.name, json.loads(tool_call.arguments)
            except Exception as e:
                if self._should_stop_for_error(e):
                    raise ToolParseError from e
                tool_messages.append(ToolMessage(content=self.error_formatter(e), tool_call_id=tool_call.id))
                continue
            try:
                tool_messages.append(await self.call_tool(tool_name, tool_args, tool_call.id))
            except Exception as e:
                if self._should_stop_for_error(e):
                    raise ToolCallError from e
                tool_messages.append(ToolMessage(content=self.error_formatter(e), tool_call_id=tool_call.id))
        return tool_messages


def filter_signature(func, args_to_skip):
    """A wrapper whose signature hides `args_to_skip`, for the schema."""
    if not args_to_skip:
        return func
    sig = inspect.signature(func)

    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = func.__name__, func.__doc__
    wrapper.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items()
                                                    if n not in args_to_skip and n != "self"])
    wrapper.__annotations__ = {k: v for k, v in func.__annotations__.items() if k not in args_to_skip}
    return wrapper


class StatefulToolEnv(ToolEnv):
    def __init__(self, tools: list[Callable] | None = None, max_turns: int = 10, **kwargs):
        super().__init__(tools=tools, max_turns=max_turns, **kwargs)
        self.skipped_args: dict[str, list[str]] = {}

    def add_tool(self, tool: Callable, args_to_skip: list[str] = []):
        """Add a tool whose `args_to_skip` are hidden from the model's schema and injected by update_tool_args."""
        self.tools.append(tool)
        tool_def = convert_func_to_tool_def(filter_signature(tool, args_to_skip))
        for arg in args_to_skip:
            tool_def.parameters.get("properties", {}).pop(arg, None)
            if arg in tool_def.parameters.get("required", []):
                tool_def.parameters["required"].remove(arg)
        self.tool_defs.append(tool_def)
        self.tool_map[tool.__name__] = tool
        self.skipped_args[tool.__name__] = args_to_skip

    @abstractmethod
    def update_tool_args(self, tool_name: str, tool_args: dict, messages, state, **kwargs) -> dict:
        """Update tool arguments and/or state (in-place) based on messages and state."""

    async def env_response(self, messages, state, **kwargs):
        tool_messages = []
        for tool_call in messages[-1].tool_calls:
            try:
                tool_name, tool_args = tool_call.name, json.loads(tool_call.arguments)
                if not isinstance(tool_args, dict):
                    raise ValueError(f"Expected tool arguments to be a dict, got {type(tool_args).__name__}")
            except Exception as e:
                if self._should_stop_for_error(e):
                    raise ToolParseError from e
                tool_messages.append(ToolMessage(content=self.error_formatter(e), tool_call_id=tool_call.id))
                continue
            tool_args = self.update_tool_args(tool_name, tool_args, messages, state, **kwargs)
            try:
                tool_messages.append(await self.call_tool(tool_name, tool_args, tool_call.id))
            except Exception as e:
                if self._should_stop_for_error(e):
                    raise ToolCallError from e
                tool_messages.append(ToolMessage(content=self.error_formatter(e), tool_call_id=tool_call.id))
        return tool_messages


__all__ = ["Environment", "MultiTurnEnv", "ToolEnv", "StatefulToolEnv", "Error"]
