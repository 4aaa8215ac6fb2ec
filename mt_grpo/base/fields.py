"""`arg`: a config field with its default and one line of help, shown by --help and in docs/reference.md
(scripts/field_reference.py). Every config dataclass declares its fields with it: the trainer's
(MTGRPOScriptArguments) and the LLM judge's (rewards/judge.py's JudgeArguments). `parse_recipe` reads a recipe and
the command line into a config. A module of its own, importing nothing of ours, so that any module can declare
recipe fields."""

import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from dataclasses import field, fields


class Choices:
    """A field's allowed values: a collection, or a function returning one (a table defined below the config, as
    ADVANTAGE_MODES is), read when a value is checked. A dict's values may have a `help`, which the reference shows.
    `renamed`: old values, each refused with its new name. argparse takes it as `choices`, so that --help lists them;
    it lets every value through (`in` is always true), and check_choices judges the CLI's values and the recipe's
    alike, with one message that names the field (and a renamed value's new name)."""

    def __init__(self, values, renamed: dict[str, str] | None = None):
        self.values, self.renamed = values, dict(renamed or {})

    def table(self):
        return self.values() if callable(self.values) else self.values

    def __iter__(self):
        return iter(list(self.table()))

    def __contains__(self, value) -> bool:  # argparse's test: check_choices is the one
        return True

    def allows(self, value) -> bool:
        return value in self.table()

    def describe(self) -> str:
        table = self.table()
        return " | ".join(f"{k} ({table[k].help})" if getattr(table.get(k) if isinstance(table, dict) else None,
                                                               "help", None) else str(k) for k in table)


class Help(str):
    """A field's help text, which also marks the field as ours (check_values) and carries its `minimum`: TRL's parser
    hands a field's metadata to argparse's add_argument as keywords, so the metadata holds argparse's keys only."""

    def __new__(cls, text: str, minimum: float | None = None):
        help_ = super().__new__(cls, text)
        help_.minimum = minimum
        return help_


def arg(default, help: str, choices=None, minimum: float | None = None):
    """A config field: its default, one line of help (shown by --help and in docs/reference.md) and, with
    `choices` (a collection or a Choices), the values it may take, checked by check_choices at construction; its
    type (the annotation) and `minimum` (the least value it takes) are checked by check_values."""
    metadata = {"help": Help(help, minimum)}
    if choices is not None:
        metadata["choices"] = choices if isinstance(choices, Choices) else Choices(tuple(choices))
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def check_choices(config) -> None:
    """Every field declared with `choices` holds one of them (a renamed value: the error names the new one)."""
    for f in fields(config):
        allowed, value = f.metadata.get("choices"), getattr(config, f.name, None)
        if not isinstance(allowed, Choices) or allowed.allows(value):  # (transformers' fields check their own)
            continue
        if value in allowed.renamed:
            raise ValueError(f"`{f.name}: {value}` is now `{f.name}: {allowed.renamed[value]}`: rename it.")
        raise ValueError(f"`{f.name}` is {value!r}; choose one of {list(allowed)}.")


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def _kinds(hint) -> tuple[tuple[type, ...], bool]:
    """(the plain types a field's annotation allows, whether it allows None); () where it is none of them."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    plain = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
    return tuple(k for k in plain if k in _KIND_NAMES), type(None) in args


def _fits(value, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python: only a bool field takes one
        return bool in kinds
    return any(isinstance(value, int if k is float else k) or (k is float and isinstance(value, float))
               for k in kinds)


def check_values(config) -> None:
    """Every field declared with `arg` holds a value of its annotated type (an integer where it says int: `2.5` and
    `true` are refused; None only where the type allows it) at least its `minimum`; the error is one line naming the
    field, what it takes and the value given."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        if not isinstance(f.metadata.get("help"), Help) or f.name not in hints:
            continue
        kinds, optional = _kinds(hints[f.name])
        value, minimum = getattr(config, f.name, None), f.metadata["help"].minimum
        if not kinds or (value is None and optional):
            continue
        ok = value is not None and _fits(value, kinds) and (minimum is None or value >= minimum)
        if not ok:
            takes = " or ".join(_KIND_NAMES[k] for k in kinds) + (f" ≥ {minimum:g}" if minimum is not None else "")
            given = "null" if value is None else f"{value!r} ({type(value).__name__})"
            raise ValueError(f"`{f.name}` takes {takes}{' or null' if optional else ''}; the config gave {given}.")


def choices_of(config, name: str) -> list:
    """The values the field `name` of `config` allows, as its `choices` declare them now (a table's current keys)."""
    field_ = next(f for f in fields(config) if f.name == name)
    return list(field_.metadata["choices"])


def parse_recipe(argv: list[str] | None, config_class) -> tuple:
    """(config, model arguments) of `--config RECIPE` and flags (TRL's parser: flags override the recipe, unknown
    keys fail), with errors that say what to fix."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # A recipe names the user's modules by dotted path (`my_env:Env`, `my_rewards:score`), and a user runs the trainer
    # from their own folder; Python puts the script's folder (the repository) on sys.path, not that one. Last, so
    # that a module of theirs shadows no package.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    if "--config" in argv:
        path = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else ""
        if not os.path.isfile(path):
            raise SystemExit(f"Recipe file not found: {path!r}. Pass an existing YAML, e.g. --config "
                             "hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml")
    from trl import ModelConfig, TrlParser  # here: a field (`arg`) needs no TRL (engine/packing's run without it)

    parser = TrlParser((constructor_keywords(config_class), ModelConfig))
    known = sorted({o.lstrip("-") for a in parser._actions for o in a.option_strings if o.startswith("--")})

    def error(message: str):  # argparse's own prints the whole usage (about 300 lines) before the one that matters
        message = re.sub(r"(--[\w.]+)/--[\w.-]+", r"\1", message)  # "--tool_timeout/--tool-timeout": one name
        raise SystemExit(f"mt_grpo_trainer.py: error: {message}{nearest_keys(message, known)}. See `python "
                         "mt_grpo_trainer.py --help` for every field.")

    parser.error = error
    try:
        keywords, model_args = parser.parse_args_and_config(argv)
        return config_class(**vars(keywords)), model_args
    except ValueError as e:
        if "Unknown arguments" in str(e):
            raise SystemExit(f"{e}{nearest_keys(str(e), known)}\nThese keys are not fields of MTGRPOConfig "
                             "(MTGRPOScriptArguments and GRPOConfig) or ModelConfig; see `python mt_grpo_trainer.py "
                             "--help`.") from e
        raise


def nearest_keys(message: str, known: list[str]) -> str:
    """"; did you mean ..." for each unknown `--key` a parser error names that is close to a known field."""
    guesses = []
    for key in dict.fromkeys(re.findall(r"--([A-Za-z0-9_.-]+)", message)):
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            guesses += [f"`{key}`: did you mean `{close[0]}`?"] if close else []
    return ("; " + " ".join(guesses)) if guesses else ""


def constructor_keywords(config_class):
    """A plain dataclass whose fields are `config_class`'s constructor keywords, with their defaults and help: its
    fields and its InitVars, which TRL's parser leaves out (MTGRPOConfig takes `dataset_name` and `dataset_config`
    so, mt_grpo_trainer.py), so that a recipe sets every one, and the config is made once, with all of them."""
    keywords, hints = [], typing.get_type_hints(config_class)
    for f in config_class.__dataclass_fields__.values():
        if not f.init or f.name not in hints:
            continue
        kind = hints[f.name].type if isinstance(hints[f.name], dataclasses.InitVar) else hints[f.name]
        keywords.append((f.name, kind, field(default=f.default, default_factory=f.default_factory,
                                             metadata=f.metadata)))
    return dataclasses.make_dataclass(config_class.__name__, keywords)
