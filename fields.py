"""`arg`: a config field with its default and one line of help, shown by --help and in docs/reference.md
(scripts/field_reference.py). Every config dataclass declares its fields with it: the trainer's
(MTGRPOScriptArguments) and the LLM judge's (rewards/judge.py's JudgeArguments). `parse_recipe` reads a recipe and
the command line into a config. A module of its own, importing nothing of ours, so that any module can declare
recipe fields."""

import os
import sys
from dataclasses import field

from trl import ModelConfig, TrlParser


def arg(default, help: str):
    """A config field: its default and one line of help (shown by --help and in docs/reference.md)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def parse_recipe(argv: list[str] | None, config_class) -> tuple:
    """(config, model arguments) of `--config RECIPE` and flags (TRL's parser: flags override the recipe, unknown
    keys fail), with errors that say what to fix."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        path = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else ""
        if not os.path.isfile(path):
            raise SystemExit(f"Recipe file not found: {path!r}. Pass an existing YAML, e.g. --config "
                             "hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml")
    parser = TrlParser((config_class, ModelConfig))
    try:
        return parser.parse_args_and_config(argv)
    except ValueError as e:
        if "Unknown arguments" in str(e):
            raise SystemExit(f"{e}\nThese keys are not fields of MTGRPOConfig (MTGRPOScriptArguments and "
                             "GRPOConfig) or ModelConfig; see `python mt_grpo_trainer.py --help`.") from e
        raise
