"""`arg`: a config field with its default and one line of help, shown by --help and in docs/reference.md
(scripts/field_reference.py). Every config dataclass declares its fields with it: the trainer's
(MTGRPOScriptArguments) and the LLM judge's (rewards/judge.py's JudgeArguments). A module of its own, importing
nothing of ours, so that any module can declare recipe fields."""

from dataclasses import field


def arg(default, help: str):
    """A config field: its default and one line of help (shown by --help and in docs/reference.md)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
