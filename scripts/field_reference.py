"""The recipe-field table of docs/reference.md, generated from MTGRPOScriptArguments: one row per field,
with its default and its `help`. The dataclass is the source; the table is never edited by hand.

    python scripts/field_reference.py            # print the table
    python scripts/field_reference.py --write    # put it between the markers in docs/reference.md
    python scripts/field_reference.py --check    # exit 1 if docs/reference.md's table is out of date
"""

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

REFERENCE = os.path.join(ROOT, "docs", "reference.md")
START, END = "<!-- fields:start -->", "<!-- fields:end -->"


def _value(value) -> str:
    """A default as a recipe would write it: strings and lists in backticks, None as None."""
    if value is None:
        return "None"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return str(value)


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return _value(f.default_factory())
    if f.default is not dataclasses.MISSING:
        return _value(f.default)
    return "required"


def _cell(text: str) -> str:
    """Markdown table cell: `|` escaped everywhere; `<` escaped outside code spans, where it would start
    an HTML tag (`<output_dir>`, `<tool>`)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def field_table() -> str:
    """The markdown table, one row per field of MTGRPOScriptArguments, in declaration order: its own fields, then
    those it inherits (the judge's, mt_grpo/rewards/judge.py), which a dataclass would list first."""
    from mt_grpo_trainer import MTGRPOScriptArguments

    own = MTGRPOScriptArguments.__annotations__
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for f in sorted(dataclasses.fields(MTGRPOScriptArguments), key=lambda f: f.name not in own):
        rows.append(f"| `{f.name}` | {_cell(_default(f))} | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows) + "\n"


def table_in(text: str) -> str:
    """The text between the markers (without them), as --write leaves it."""
    if START not in text or END not in text:
        raise ValueError(f"docs/reference.md lacks the lines {START} and {END}")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table}{END}{rest.split(END, 1)[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in docs/reference.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md's table is out of date")
    args = parser.parse_args()
    table = field_table()
    if not (args.write or args.check):
        print(table, end="")
        return 0
    with open(REFERENCE) as f:
        text = f.read()
    if args.check:
        if table_in(text) != table:
            print("docs/reference.md's recipe-field table differs from MTGRPOScriptArguments: "
                  "run scripts/field_reference.py --write", file=sys.stderr)
            return 1
        print("docs/reference.md's recipe-field table is up to date")
        return 0
    new = with_table(text, table)
    if new != text:
        with open(REFERENCE, "w") as f:
            f.write(new)
    print(f"wrote the recipe-field table ({table.count(chr(10)) - 2} fields) to docs/reference.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
