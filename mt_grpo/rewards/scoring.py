"""Each reward function called once on the batch, its values checked and laid out as the trainer's tensors (section 2
of mt_grpo_trainer.py weighs and normalises them)."""

from typing import Callable

import torch

from mt_grpo.rewards import check_reward_count, failing_sample, is_per_tool_turn, reward_value


def compute_rewards_per_func(funcs: list[Callable], prompts: list, completions: list, columns: dict,
                             tool_turns: list[int] | None = None, max_turns: int = 1,
                             keywords: dict | None = None) -> torch.Tensor:
    """Rewards, each function called once for the whole batch: (B, F), or with `tool_turns` (tool turns of
    each sample) (B, F, max_turns). `columns`: a list per keyword, a value per sample; `keywords`: TRL's
    others, for the batch (trainer_state, log_extra, log_metric). A per-turn function (`fn.per_tool_turn`, rewards/conversation.py)
    returns a list per sample, one value per tool turn, which fills [i, f, :turns] (one more: the final model
    turn's, [i, f, turns], gym's final step); a per-sample value fills [i, f, 0]. None -> NaN ("not applicable"); a NaN or inf, a wrong count, or an exception is an
    error naming the function and sample."""
    B = len(prompts)
    out = torch.full((B, len(funcs), max_turns), float("nan"))
    for f, fn in enumerate(funcs if B else []):  # no sample (an evaluation rank with no question): no call
        name = getattr(fn, "__name__", repr(fn))
        per_tool_turn = is_per_tool_turn(fn)
        if per_tool_turn and tool_turns is None:
            raise ValueError(f"Reward function '{name}' is per-turn (@per_tool_turn): list it in "
                             "`turn_reward_funcs`.")
        try:
            values = fn(prompts=prompts, completions=completions, **columns, **(keywords or {}))
        except Exception as e:
            raise RuntimeError(f"Reward function '{name}' raised on sample "
                               f"{failing_sample(fn, prompts, completions, columns, keywords or {})}: "
                               f"{type(e).__name__}: {e}") from e
        check_reward_count(name, values, B)
        for i, v in enumerate(values):
            if per_tool_turn:
                if not isinstance(v, (list, tuple)) or len(v) not in (tool_turns[i], tool_turns[i] + 1):
                    raise ValueError(f"Per-turn reward function '{name}' returned {v!r} for sample {i}, "
                                     f"which has {tool_turns[i]} tool turns: return one value (or None) per "
                                     "tool turn (and optionally one more, the final model turn's).")
                for k, x in enumerate(v[:max_turns]):
                    out[i, f, k] = reward_value(name, i, x)
            else:
                out[i, f, 0] = reward_value(name, i, v)
    return out if tool_turns is not None else out[:, :, 0]
