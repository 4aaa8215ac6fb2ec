"""What launch.sh and scripts/slurm_launch.sh need from a recipe, read as the trainer reads it.

    python scripts/recipe_values.py RECIPE.yaml [trainer flags...]

prints shell assignments for the launchers to eval: MODEL, TOOL_FORMAT, USE_PEFT, LORA_R, FP16. The recipe is read
with yaml.safe_load, as TRL's TrlParser reads it, so quoting, YAML's booleans (`True`, `yes`, `on`) and CRLF line
ends mean what they mean to the trainer. A key among the trainer flags overrides the recipe's, as on the trainer's
command line: the last one wins, and a bare `--use_peft` means true. A value the trainer would refuse stops the
launcher here, with the key named (exit 2). Only the standard library and PyYAML: importing TRL would add seconds.
"""

import shlex
import sys

# transformers.hf_argparser.string_to_bool's words, which TRL applies to a boolean given as text (flag or quoted)
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")
BOOL_KEYS = ("use_peft", "fp16")


def fail(message: str):
    print(f"recipe_values.py: {message}", file=sys.stderr)
    sys.exit(2)


def as_bool(key: str, value) -> bool:
    if not isinstance(value, str):
        return bool(value)  # a YAML boolean, or a number or null that argparse keeps as it is
    if value.lower() in TRUE_WORDS:
        return True
    if value.lower() in FALSE_WORDS:
        return False
    fail(f"{key}: {value!r} is not a boolean (true or false)")


def flag_values(flags: list[str]) -> dict:
    """The trainer flags as {key: value}, the last one of a key winning; a bare boolean flag is true."""
    values, i = {}, 0
    while i < len(flags):
        if not flags[i].startswith("--"):
            i += 1
            continue
        key, eq, value = flags[i][2:].partition("=")
        if eq:
            i += 1
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value, i = flags[i + 1], i + 2
        elif key in BOOL_KEYS:
            value, i = True, i + 1
        else:
            i += 1
            continue
        values[key] = value
    return values


def main(recipe: str, flags: list[str]):
    try:
        import yaml
    except ImportError:
        fail(f"{sys.executable} has no PyYAML: set PYTHON to the interpreter with trl installed")
    try:
        with open(recipe, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        fail(f"cannot read the recipe {recipe}: {e}")
    if not isinstance(config, dict):
        fail(f"the recipe {recipe} is not a YAML mapping of field: value")
    config = {**config, **flag_values(flags)}
    model = config.get("model_name_or_path")
    if not model or not isinstance(model, str):
        fail(f"{recipe} has no model_name_or_path")
    lora_r = config.get("lora_r", 16)  # TRL's ModelConfig default
    try:
        lora_r = int(lora_r)
    except (TypeError, ValueError):
        fail(f"lora_r: {lora_r!r} is not a whole number")
    values = {"MODEL": model, "TOOL_FORMAT": config.get("tool_format") or "auto", "LORA_R": lora_r,
              **{key.upper(): str(as_bool(key, config.get(key, False))).lower() for key in BOOL_KEYS}}
    for name, value in values.items():
        print(f"{name}={shlex.quote(str(value))}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        fail("usage: recipe_values.py RECIPE.yaml [trainer flags...]")
    main(sys.argv[1], sys.argv[2:])
