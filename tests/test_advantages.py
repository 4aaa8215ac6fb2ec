"""Hand-computed advantage cases: group normalisation, the guard for equal rewards, None rewards,
and per-token assignment in all three advantage modes."""

import math

import pytest
import torch

from mt_grpo_trainer import (
    Span,
    compute_rewards_per_func,
    group_normalize,
    result_start,
    token_advantages,
    truncated_importance_weights,
    weighted_reward,
)

NAN = float("nan")


def test_normal_group_is_centred_and_scaled_by_sample_std():
    # rewards 0, 1, 2, 3: mean 1.5, sample std sqrt(5/3)
    adv = group_normalize(torch.tensor([0.0, 1.0, 2.0, 3.0]), num_generations=4)
    std = math.sqrt(5 / 3)
    assert adv.tolist() == pytest.approx([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std])


def test_each_group_is_normalised_on_its_own():
    adv = group_normalize(torch.tensor([1.0, 3.0, 10.0, 30.0]), num_generations=2)
    s = math.sqrt(2.0)  # sample std of {1, 3} is sqrt(2); of {10, 30} sqrt(200)
    assert adv.tolist() == pytest.approx([-1 / s, 1 / s, -1 / s, 1 / s])


@pytest.mark.parametrize("value", [0.0, 0.1, 0.7, 1e6])
def test_group_with_equal_rewards_gets_exactly_zero(value):
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: without a guard, rounding noise / tiny std blows up.
    adv = group_normalize(torch.tensor([value, value, value]), num_generations=3)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_none_rewards_are_left_out_of_the_group_statistics_and_get_zero():
    adv = group_normalize(torch.tensor([1.0, NAN, 3.0, 2.0]), num_generations=4)
    # valid {1, 3, 2}: mean 2, sample std 1
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0])


def test_weighted_reward_skips_none_but_keeps_all_none_rows_nan():
    rpf = torch.tensor([[1.0, 0.5], [NAN, 0.5], [NAN, NAN]])
    total = weighted_reward(rpf, torch.tensor([2.0, 1.0]))
    assert total[:2].tolist() == [2.5, 0.5] and math.isnan(total[2])


def test_result_start_is_first_env_span_or_length():
    spans = [Span("model", 0, 5), Span("env", 5, 9), Span("model", 9, 12), Span("env", 12, 15)]
    assert result_start(spans, 20) == 5
    assert result_start([Span("model", 0, 7)], 20) == 20


A_O = torch.tensor([1.0, -1.0])
A_T = torch.tensor([0.5, 2.0])
A_M = torch.tensor([0.25, -0.25])


def test_mt_grpo_assigns_turn_advantage_before_first_result_only():
    # row 0: first <result> at 3 (one tool call); row 1: no tool call, so no <result>: start = T
    adv = token_advantages("mt_grpo", A_O, A_T, A_M, torch.tensor([3, 6]), 6, turn_advantage_coef=0.5)
    assert adv[0].tolist() == [1.25, 1.25, 1.25, 1.0, 1.0, 1.0]
    # a trajectory that never called a tool: its whole completion is its first turn
    assert adv[1].tolist() == [0.0] * 6


def test_mt_grpo_with_several_tool_calls_splits_at_the_first_result():
    spans = [Span("model", 0, 2), Span("env", 2, 4), Span("model", 4, 5), Span("env", 5, 7), Span("model", 7, 8)]
    start = torch.tensor([result_start(spans, 8)])
    adv = token_advantages("mt_grpo", torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.0]), start, 8, 1.0)
    assert adv[0].tolist() == [2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_outcome_only_and_merged_ignore_turn_positions():
    starts = torch.tensor([2, 4])
    assert token_advantages("outcome_only", A_O, A_T, A_M, starts, 4, 1.0).tolist() == [[1.0] * 4, [-1.0] * 4]
    assert token_advantages("merged", A_O, A_T, A_M, starts, 4, 1.0).tolist() == [[0.25] * 4, [-0.25] * 4]


def test_end_to_end_group_of_four_by_hand():
    # Two prompts' worth of one group: turn rewards from tool use, outcome rewards from the answer.
    R_T = torch.tensor([0.7, 0.7, 0.2, 0.0])
    R_O = torch.tensor([1.0, 0.0, 0.0, 0.0])
    A_T, A_O = group_normalize(R_T, 4), group_normalize(R_O, 4)
    assert A_O.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])  # mean .25, sample std .5
    mean_t = 0.4
    std_t = math.sqrt(((0.3) ** 2 * 2 + 0.2**2 + 0.4**2) / 3)
    assert A_T.tolist() == pytest.approx([(r - mean_t) / std_t for r in R_T.tolist()])
    adv = token_advantages("mt_grpo", A_O, A_T, A_O, torch.tensor([1, 1, 1, 3]), 3, 1.0)
    assert adv[0].tolist() == pytest.approx([1.5 + A_T[0].item(), 1.5, 1.5])
    assert adv[3].tolist() == pytest.approx([-0.5 + A_T[3].item()] * 3)


def test_reward_function_runs_once_per_batch_and_none_becomes_nan():
    calls = []

    def reward(prompts, completions, answer, **kwargs):
        calls.append(len(completions))
        return [1.0, None]

    out = compute_rewards_per_func([reward], ["p", "p"], [[], []], {"answer": [["a"], ["b"]]})
    assert calls == [2]
    assert out[0, 0].item() == 1.0 and math.isnan(out[1, 0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0"])
def test_reward_function_returning_non_finite_is_rejected_with_its_name(bad):
    def shaky_reward(prompts, completions, **kwargs):
        return [0.0, bad]

    with pytest.raises(ValueError, match=r"'shaky_reward' returned .* for sample 1"):
        compute_rewards_per_func([shaky_reward], ["p", "p"], [[], []], {})


def test_reward_function_that_raises_is_named_with_the_failing_sample():
    def picky_reward(prompts, completions, answer, **kwargs):
        return [1.0 / len(a) for a in answer]  # ZeroDivisionError on an empty alias list

    with pytest.raises(RuntimeError, match=r"'picky_reward' raised on sample 2: ZeroDivisionError"):
        compute_rewards_per_func([picky_reward], ["p"] * 3, [[]] * 3, {"answer": [["a"], ["b"], []]})


def test_truncated_importance_weights_cap_and_ignore_env_tokens():
    trainer = torch.tensor([[0.0, 0.0, -1.0]])
    sampler = torch.tensor([[0.0, -5.0, 0.0]])  # ratios 1, e^5 (capped at 2), e^-1
    mask = torch.tensor([[1, 1, 0]])
    w = truncated_importance_weights(trainer, sampler, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 1.0])
