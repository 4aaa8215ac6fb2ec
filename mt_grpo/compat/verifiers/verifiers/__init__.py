# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
"""A faithful copy of the classic (v0) surface of verifiers 0.1.14 (`pip download --no-deps verifiers==0.1.14`;
the same classes are `verifiers.legacy` in 0.3.x), shipped with mt-grpo so that an environment written
for classic verifiers runs without installing it (mt_grpo/compat/__init__.py puts this folder's parent first on
sys.path only when the real verifiers does not import; an installed one wins). The real package does
not import without openai, anthropic and prime-sandboxes (a protobuf/connectrpc stack), so this copy carries the
parts an environment module touches, with the same names, signatures and behaviour:

    vf.Environment / MultiTurnEnv / ToolEnv / StatefulToolEnv   dataset formatting, tool_defs, @vf.stop conditions,
                                                                 is_completed(state), env_response, update_tool_args
    vf.Parser / XMLParser / ThinkParser                          parse, parse_answer, get_format_reward_func
    vf.Rubric                                                    funcs and weights, named-argument calls, score_rollout
    vf.stop, vf.cleanup, vf.Messages, vf.State, vf.Error ...

Left out: the rollout loop against a model client (the trainer runs the episode), the serving and evaluation
stacks, and openai-agents' schema builder (`convert_func_to_tool_def` uses transformers' get_json_schema, which
reads the same Google-style docstrings)."""

from .errors import Error, ToolCallError, ToolParseError  # noqa: F401
from .types import (AssistantMessage, Messages, State, SystemMessage, Tool, ToolCall, ToolMessage,  # noqa: F401
                    UserMessage)
from .decorators import cleanup, stop  # noqa: F401
from .parsers import Parser, ThinkParser, XMLParser  # noqa: F401
from .rubric import Rubric  # noqa: F401
from .envs import Environment, MultiTurnEnv, StatefulToolEnv, ToolEnv  # noqa: F401

__version__ = "0.1.14"
