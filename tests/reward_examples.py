"""Reward functions used by tests through dotted paths (`reward_examples:needs_gold`)."""

from mt_grpo.rewards import count_tool_turns, per_tool_turn


def needs_gold(prompts, completions, gold, **kwargs):
    return [1.0 for _ in completions]


@per_tool_turn
def one_per_tool_turn(prompts, completions, **kwargs):
    """1.0 for every tool turn: a per-turn reward of the right shape."""
    return [[1.0] * count_tool_turns(c) for c in completions]


@per_tool_turn
def one_value_too_many(prompts, completions, **kwargs):
    """A per-turn reward that breaks its contract: two values more than there are tool turns (one more is the final
    model turn's)."""
    return [[1.0] * (count_tool_turns(c) + 2) for c in completions]
