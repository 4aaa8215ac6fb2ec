# Copied and abridged from verifiers 0.1.14 (MIT License, Copyright (c) 2025 William Brown:
# mt_grpo/compat/verifiers/LICENSE).
class Error(Exception):
    """Base class of the errors a rollout records in state["error"] (verifiers/errors.py)."""


class ToolError(Error):
    pass


class ToolParseError(ToolError):
    pass


class ToolCallError(ToolError):
    pass
