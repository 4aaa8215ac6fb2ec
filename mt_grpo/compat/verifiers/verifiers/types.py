# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
"""Message and tool types (verifiers/types.py): pydantic models that also answer dict access."""

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class CustomBaseModel(BaseModel):
    """Allow extras and dict-like attribute access."""

    model_config = ConfigDict(extra="allow")

    def __getitem__(self, key):
        return getattr(self, key)

    def __setitem__(self, key, value):
        setattr(self, key, value)

    def get(self, key, default=None):
        return getattr(self, key, default)

    def __contains__(self, key):
        return hasattr(self, key)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.model_dump() == dict(other)
        return super().__eq__(other)


class SystemMessage(CustomBaseModel):
    role: Literal["system"] = "system"
    content: Any


class UserMessage(CustomBaseModel):
    role: Literal["user"] = "user"
    content: Any


class ToolCall(CustomBaseModel):
    id: str
    name: str
    arguments: str


class AssistantMessage(CustomBaseModel):
    role: Literal["assistant"] = "assistant"
    content: Any = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(CustomBaseModel):
    role: Literal["tool"] = "tool"
    tool_call_id: str
    content: Any


class Tool(CustomBaseModel):
    name: str
    description: str
    parameters: dict[str, object]
    strict: bool | None = None


Message = SystemMessage | UserMessage | AssistantMessage | ToolMessage
Messages = list[Message]
State = dict  # verifiers' State is a dict subclass that forwards input fields; a dict here
Info = dict[str, Any]

MESSAGE_TYPES = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage, "tool": ToolMessage}


def normalize_messages(messages) -> Messages:
    """Dicts (or models) to the message models (verifiers/utils/message_utils.py's normalize_messages)."""
    if isinstance(messages, str):
        return [UserMessage(content=messages)]
    out = []
    for m in messages:
        if isinstance(m, BaseModel):
            out.append(m)
            continue
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = [c if isinstance(c, ToolCall) else ToolCall(**c) for c in m["tool_calls"]]
        out.append(MESSAGE_TYPES[m["role"]](**m))
    return out
