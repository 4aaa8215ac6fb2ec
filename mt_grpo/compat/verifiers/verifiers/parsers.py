# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
"""Parser, XMLParser and ThinkParser (verifiers/parsers/): what text a rubric reads from a completion."""

import re
from types import SimpleNamespace
from typing import Any, Callable


class Parser:
    """`parse` returns text as is; `parse_answer` the last assistant message's content."""

    def __init__(self, extract_fn: Callable[[str], str] = lambda x: x):
        self.extract_fn = extract_fn

    def parse(self, text: str) -> Any:
        return self.extract_fn(text)

    def _message_field(self, message: Any, field: str, default: Any = None) -> Any:
        return message.get(field, default) if isinstance(message, dict) else getattr(message, field, default)

    def _content_to_text(self, content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            return " ".join(parts).strip()
        return ""

    def get_assistant_messages(self, completion):
        return [m for m in completion if self._message_field(m, "role") == "assistant"]

    def get_user_messages(self, completion):
        return [m for m in completion if self._message_field(m, "role") == "user"]

    def get_tool_messages(self, completion):
        return [m for m in completion if self._message_field(m, "role") == "tool"]

    def parse_answer(self, completion) -> str | None:
        if isinstance(completion, str):
            return self.parse(completion)
        assistant = self.get_assistant_messages(completion)
        if not assistant:
            return None
        return self.parse(self._content_to_text(self._message_field(assistant[-1], "content", "") or ""))

    def get_format_reward_func(self) -> Callable:
        def format_reward_func(completion, **kwargs) -> float:
            return 1.0

        return format_reward_func


class XMLParser(Parser):
    """Fields in XML tags; a field may be a tuple of alternative tags (the first is canonical)."""

    def __init__(self, fields: list, answer_field: str = "answer", extract_fn: Callable[[str], str] = lambda x: x):
        super().__init__(extract_fn=extract_fn)
        self.answer_field = answer_field
        self._fields = [(f, [f]) if isinstance(f, str) else (f[0], list(f)) for f in fields]

    def parse(self, text: str, strip: bool = True, last: bool = False) -> Any:
        results = {}
        for _, alternatives in self._fields:
            for alt in alternatives:
                matches = list(re.finditer(rf"<{alt}>\s*(.*?)\s*</{alt}>", text, re.DOTALL))
                match = (matches[-1] if last else matches[0]) if matches else None
                results[alt] = (match.group(1).strip() if strip else match.group(1)) if match else None
        return SimpleNamespace(**results)

    def parse_answer(self, completion) -> str | None:
        """The last answer field of the completion (of its last assistant message that has one)."""
        if isinstance(completion, str):
            return getattr(self.parse(completion, last=True), self.answer_field, None)
        for message in reversed(self.get_assistant_messages(completion)):
            parsed = self.parse(self._content_to_text(self._message_field(message, "content", "") or ""))
            if getattr(parsed, self.answer_field, None) is not None:
                return getattr(parsed, self.answer_field)
        return None

    def get_format_str(self) -> str:
        return "\n".join(f"<{c}>\n...\n</{c}>" for c, _ in self._fields)

    def get_fields(self) -> list[str]:
        return [c for c, _ in self._fields]

    def get_format_reward_func(self) -> Callable:
        """Each assistant message: 0.4 x the share of field sets present, +0.2 proper spacing, +0.2 starts with the
        first field, +0.2 ends with the last; averaged over the messages."""

        def format_reward_func(completion) -> float:
            scores = []
            for message in self.get_assistant_messages(completion):
                content = self._content_to_text(self._message_field(message, "content", "") or "")
                parsed, raw = self.parse(content), self.parse(content, strip=False)
                present = [i for i, (_, alts) in enumerate(self._fields)
                           if any(getattr(parsed, a) is not None or f"<{a}>" in content for a in alts)]
                spacing = all(getattr(raw, a) is not None for _, alts in self._fields for a in alts
                              if getattr(parsed, a) is not None)
                score = 0.4 * len(present) / len(self._fields) if present else 0.0
                score += 0.2 * spacing
                score += 0.2 * any(content.strip().startswith(f"<{a}>") for a in self._fields[0][1])
                score += 0.2 * any(content.strip().endswith(f"</{a}>") for a in self._fields[-1][1])
                scores.append(score)
            return sum(scores) / len(scores) if scores else 0.0

        return format_reward_func


class ThinkParser(Parser):
    """The text after </think> (nothing when there is no </think>)."""

    def parse(self, text: str) -> str:
        text = text.split("</think>")[-1].strip() if "</think>" in text else ""
        return self.extract_fn(text.strip())

    def get_format_reward_func(self) -> Callable:
        def follows_format(text: str) -> float:
            return float(text.strip().startswith("<think>") and text.count("<think>") == 1
                         and text.count("</think>") == 1 and len(text.split("</think>")[-1]) > 0)

        def format_reward_func(completion, **kwargs) -> float:
            messages = self.get_assistant_messages(completion)
            return sum(follows_format(self._content_to_text(self._message_field(m, "content", "") or ""))
                       for m in messages) / len(messages) if messages else 0.0

        return format_reward_func
