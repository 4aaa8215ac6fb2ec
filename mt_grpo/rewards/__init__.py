"""Reward functions, by name.

A reward function is `fn(prompts, completions, **dataset_columns)`; `completions[i]` is the
canonical conversation of protocol.py (rewards/conversation.py reads it). Besides the dataset's columns it
receives TRL's keywords, as TRL 1.16 passes them: `completion_ids` (each episode's completion tokens, the
environment's included), `trainer_state`, `log_extra(column, values)` (a column of the completions table),
`log_metric(name, value)` (a logged metric), and `environments` (each episode's instance, in a run with an
environment_factory); and ours, `stop_reason` (why each episode ended: answer, budget, env_done, ...). A function
that requires any of them is never taken for one that lacks a column.
It returns one of two forms:

    per sample (default)   list[float | None]: one value per sample; None = "not applicable".
                           Every outcome reward, and the turn rewards that judge the whole episode
                           or its first tool turn.
    per turn (@per_tool_turn)   list[list[float | None]]: for each sample, the value of each of its tool
                           turns in order, `len(values[i]) == count_tool_turns(completions[i])`
                           ([] for a sample without a tool turn), or one more: the final model turn's.
                           Turn rewards only.

The `per_tool_turn` decorator marks the second form (`fn.per_tool_turn = True`; test it with `is_per_tool_turn`):
the trainer reads the mark and never guesses the form from the values. `tool_turns(completion)`
gives each tool turn as (assistant message, [the tool messages that answer it]), for the trainer
and the rewards alike.

To add a reward: write the function in a module under `mt_grpo/rewards/` (or your own), then either add it to
`REWARD_FUNCS` below and use its name in the recipe's `turn_reward_funcs` / `outcome_reward_funcs`
lists, or put its dotted path there (`mt_grpo.rewards.my_module:my_reward`, or any importable module).
A reward that compares with the gold answer should take the keyword `answer_aliases` (the row's accepted answers,
list[str], made by tasks/ from the `answer` column, which itself arrives as the dataset holds it, as in TRL) and
ask `rewards.answers.matches_answer` / `contains_answer`, passing the row's `answer_type` (a dataset column:
"auto", "text" or "math"), as the shipped ones do.

    @per_tool_turn
    def short_calls(prompts, completions, **kwargs):  # 0.1 for each tool turn under 300 characters
        return [[0.1 if len(content(m)) < 300 else 0.0 for m, _ in tool_turns(c)] for c in completions]
"""

import math
from typing import Callable

from mt_grpo.base.registry import resolve
from mt_grpo.rewards.conversation import (count_tool_turns, is_per_tool_turn, per_tool_turn, per_turn, step_reward,
                                          tool_turns)
from mt_grpo.rewards.triviaqa_reward import OUTCOME_REWARD_FUNCS, TURN_REWARD_FUNCS, exist_answer_in_search_results

__all__ = ["REWARD_FUNCS", "RENAMED_REWARD_FUNCS", "get_reward_func", "per_tool_turn", "per_turn", "is_per_tool_turn",
           "tool_turns", "count_tool_turns", "reward_columns"]

@per_tool_turn
def tool_rewards(prompts=None, completions=None, **kwargs) -> list[list[float | None]]:
    """Each tool turn's step rewards, summed: what its tools returned beside their output, `(output, reward)` (verl's
    function tools; rollout/tool_calls.tool_output). A turn whose tools returned none is None, not applicable (a tool
    returns `(output, 0.0)` to score 0). Any task's turn reward."""
    turns = [[[r for m in messages if (r := step_reward(m)) is not None] for _, messages in tool_turns(c)]
             for c in completions]
    return [[float(sum(rs)) if rs else None for rs in c] for c in turns]


# Old names, each its own function that calls the new one: a recipe naming it keeps its logged metric names
# (`rewards/turn/<fn.__name__>`) and `eval_metrics` entries.
RENAMED_REWARD_FUNCS = [exist_answer_in_search_results]  # now answer_in_tool_result
REWARD_FUNCS: dict[str, Callable] = {fn.__name__: fn
                                     for fn in TURN_REWARD_FUNCS + OUTCOME_REWARD_FUNCS + RENAMED_REWARD_FUNCS
                                     + [tool_rewards]}


def get_reward_func(name: str) -> Callable:
    """A registry name, or a dotted path to any importable function: `package.module:func` or
    `package.module.func` (registry.py resolves both, for tools too), as it is found. Fails with a ValueError that
    says what to change. A run looks its rewards up with adapters.resolve_reward, which adds the names and forms of
    other frameworks (an ms-swift ORM, verl's compute_score)."""
    try:
        return resolve(name, REWARD_FUNCS, "reward function")
    except ValueError as e:  # the judge rewards are built from the config (rewards/judge.py), not looked up here
        if name.startswith("judge"):
            raise ValueError(f"{e} The LLM-judge rewards are judge_outcome, judge_turn and judge_group "
                             "(rewards/judge.py; they need `judge_base_url`).") from None
        raise


def reward_columns(inputs: list[dict]) -> dict[str, list]:
    """The dataset's columns, as the keyword arguments every reward function receives (TRL's convention):
    each column's values over the batch. `prompt` goes positionally; `row` is ours (the eval question's index)."""
    return {k: [x[k] for x in inputs] for k in inputs[0] if k not in ("prompt", "row")} if inputs else {}


def failing_sample(fn: Callable, prompts: list, completions: list, columns: dict, keywords: dict) -> str:
    """Which sample makes a batch reward function raise, found by calling it on one sample at a time (`columns`: a
    value per sample; `keywords`: for the batch), for the trainer's error."""
    for i in range(len(prompts)):
        try:
            fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1],
               **{k: v[i : i + 1] for k, v in columns.items()}, **keywords)
        except Exception:
            return str(i)
    return "(the batch only; no single sample raises)"


def check_reward_count(name: str, values, samples: int) -> None:
    """A reward function returns a list of one value per sample (or what TRL also takes: a tuple, an array)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise ValueError(f"Reward function '{name}' returned {type(values).__name__} {values!r:.60}, not a list: return "
                         f"a list of {samples} values, one per sample (a float, or None for 'not applicable').")
    if len(values) != samples:
        raise ValueError(f"Reward function '{name}' returned {len(values)} values for {samples} samples: return "
                         "one value per completion it was given.")


def reward_value(name: str, i: int, v) -> float:
    """One sample's reward as a float: None -> NaN ("not applicable"). What TRL's `torch.tensor(rewards)` takes is
    taken (a bool, a numpy number, a one-element tensor), so a TRL reward trains unchanged; text, a list, or a NaN
    or inf is an error naming the function and the sample."""
    if v is None:
        return float("nan")
    try:
        value = None if isinstance(v, (str, bytes)) else float(v)
    except (TypeError, ValueError, RuntimeError):  # a list, a dict, a tensor of several elements
        value = None
    if value is None or not math.isfinite(value):
        raise ValueError(f"Reward function '{name}' returned {v!r} for sample {i}: rewards must be finite "
                         "numbers, or None for 'not applicable'.")
    return value
