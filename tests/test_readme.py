"""The README documents every config field and every metric the trainer logs."""

import dataclasses
import os
import re

from helpers import ROOT
from mt_grpo_trainer import MTGRPOScriptArguments


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_every_config_field_has_a_row_in_the_recipe_table():
    text = readme()
    missing = [f.name for f in dataclasses.fields(MTGRPOScriptArguments) if f"| `{f.name}` |" not in text]
    assert not missing, f"README's recipe-field table lacks {missing}"


def test_every_config_field_has_help():
    assert all(f.metadata.get("help") for f in dataclasses.fields(MTGRPOScriptArguments))


def documented_metric(name: str, text: str) -> bool:
    """`rewards/turn/exact_match_reward_func` is documented by the row `rewards/turn/<func>`, and
    `rollout/stop/answer` by `rollout/stop/<reason>` when that row names `answer`."""
    generic = re.sub(r"^(rewards/(turn|outcome))/(?!mean$|frac_zero_std_groups$)[^/]+$", r"\1/<func>", name)
    stop = re.match(r"^rollout/stop/(.+)$", name)
    if stop:
        row = next((line for line in text.splitlines() if line.startswith("| `rollout/stop/<reason>` |")), "")
        return f"`{stop.group(1)}`" in row
    return f"`{generic}`" in text


def test_metrics_logged_by_a_smoke_run_are_documented(smoke_metrics):
    text = readme()
    missing = [k for k in smoke_metrics if not documented_metric(k, text)]
    assert not missing, f"README's metrics table lacks {missing}"
