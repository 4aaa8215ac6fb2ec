"""Reward functions used by tests through dotted paths (`reward_examples:needs_gold`)."""


def needs_gold(prompts, completions, gold, **kwargs):
    return [1.0 for _ in completions]
