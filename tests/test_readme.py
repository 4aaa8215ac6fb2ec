"""The documentation: the README stays a front door, docs/reference.md documents every config field (its table
generated from the dataclass) and every metric the trainer logs, and no relative link is broken."""

import dataclasses
import glob
import os
import re

from field_reference import REFERENCE, field_table, table_in
from helpers import ROOT
from mt_grpo_trainer import MTGRPOScriptArguments

README_MAX_LINES = 200


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def markdown_files() -> list[str]:
    return (["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
            + ["studies/README.md", "tests/README.md"])


def test_readme_is_a_front_door():
    lines = len(read("README.md").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_recipe_field_table_is_generated_from_the_dataclass():
    assert table_in(read(REFERENCE)) == field_table(), \
        "docs/reference.md's recipe-field table differs from MTGRPOScriptArguments: run scripts/field_reference.py --write"


def test_every_config_field_has_help():
    assert all(f.metadata.get("help") for f in dataclasses.fields(MTGRPOScriptArguments))


def documented_metric(name: str, text: str) -> bool:
    """`rewards/turn/exact_match_reward_func` is documented by the row `rewards/turn/<func>` (and likewise under
    `dynamic_sampling/first_draw/` and `dynamic_sampling/replacements/`), TRL's `rewards/exact_match_reward_func/mean`
    by `rewards/<func>/mean`, and `rollout/stop/answer` by `rollout/stop/<reason>` when that row names `answer`."""
    generic = re.sub(r"^((dynamic_sampling/(first_draw|replacements)/)?rewards/(turn|outcome))/"
                     r"(?!mean$|frac_zero_std_groups$)[^/]+$", r"\1/<func>", name)
    generic = re.sub(r"^rewards/(?!turn/|outcome/)[^/]+/(mean|std)$", r"rewards/<func>/\1", generic)
    stop = re.match(r"^rollout/stop/(.+)$", name)
    if stop:
        row = next((line for line in text.splitlines() if line.startswith("| `rollout/stop/<reason>` |")), "")
        return f"`{stop.group(1)}`" in row
    return f"`{generic}`" in text


def test_metrics_logged_by_a_smoke_run_are_documented(smoke_metrics):
    text = read(REFERENCE)
    missing = [k for k in smoke_metrics if not documented_metric(k, text)]
    assert not missing, f"docs/reference.md's metrics table lacks {missing}"


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens (-1, -2 for repeats)."""
    seen, out = {}, set()
    for line in without_code(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def without_code(text: str) -> str:
    """The text without fenced code blocks, where `](x)` and `# x` are not links or headings."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_relative_links_resolve():
    """Every `](path)` and `](path#anchor)` in README.md, docs/*.md, studies/README.md and tests/README.md that is
    not a web address points to an existing file, and an anchor into a markdown file to one of its headings."""
    broken = []
    for doc in markdown_files():
        text = read(doc)
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(text)):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(ROOT, file)):
                broken.append(f"{doc}: {target} (no file {file})")
            elif anchor and file.endswith(".md") and anchor not in anchors(read(file)):
                broken.append(f"{doc}: {target} (no heading #{anchor} in {file})")
    assert not broken, "broken links:\n" + "\n".join(broken)
