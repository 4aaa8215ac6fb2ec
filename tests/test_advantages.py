"""Hand-computed advantage cases: group normalisation, the guard for equal rewards, None rewards,
and per-token assignment in all three advantage modes."""

import math

import pytest
import torch

from mt_grpo_trainer import (AdvantageSettings, ADVANTAGE_MODES, AdvantageMode, compute_rewards_per_func, group_normalize,
                             importance_weights, mt_grpo_advantages, turn_reward_table, resolve_advantage_mode,
                             weighted_reward, zero_signal_scale)
from mt_grpo.rollout.episodes import Span, result_start, token_turn_index
from mt_grpo.run.checks import check_reward_columns
from mt_grpo.engine.weight_sync import probe_verdict

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


def turns(*spans_per_row, length):
    """(B, T) model-turn index of each token, from each row's spans."""
    return torch.stack([token_turn_index(spans, length) for spans in spans_per_row])


def test_token_turn_index_follows_the_spans():
    spans = [Span("model", 0, 2), Span("env", 2, 4), Span("model", 4, 5), Span("env", 5, 7), Span("model", 7, 8)]
    assert token_turn_index(spans, 10).tolist() == [0, 0, -1, -1, 1, -1, -1, 2, -1, -1]
    assert result_start(spans, 10) == 2 and result_start([Span("model", 0, 7)], 10) == 10


# Two groups of two: R_O (1, 0) and (0, 2); R_T (0.5, 0) and (1, 1) (equal: A_T = 0 in group 2).
R_O = torch.tensor([1.0, 0.0, 0.0, 2.0])
R_T = torch.tensor([0.5, 0.0, 1.0, 1.0])
S = 1 / math.sqrt(2)  # a group of two {a, b}: (a - mean) / sample std = +-1/sqrt(2)
ROWS = turns([Span("model", 0, 3), Span("env", 3, 5), Span("model", 5, 6)],  # a tool call, then an answer
             [Span("model", 0, 6)],  # no tool call: the whole completion is its first turn
             [Span("model", 0, 2), Span("env", 2, 4)],  # padded from 4 to 6
             [Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3), Span("env", 3, 4), Span("model", 4, 6)],
             length=6)


def test_mt_grpo_gives_turn_credit_before_the_first_result_only():
    adv = mt_grpo_advantages(R_T, R_O, ROWS, AdvantageSettings.of("mt_grpo", 2, turn_advantage_coef=0.5))
    assert adv.outcome.tolist() == pytest.approx([S, -S, -S, S])
    assert adv.turn[:, 0].tolist() == pytest.approx([S, -S, 0.0, 0.0])
    assert adv.tokens[0].tolist() == pytest.approx([S + 0.5 * S] * 3 + [S] * 3)
    assert adv.tokens[1].tolist() == pytest.approx([-S - 0.5 * S] * 6)
    assert adv.tokens[3].tolist() == pytest.approx([S] * 6)  # A_T = 0 in its group
    assert adv.informative.tolist() == [True] * 4


def test_baselines_ignore_turn_positions():
    only = mt_grpo_advantages(R_T, R_O, ROWS, AdvantageSettings.of("outcome_only", 2, turn_advantage_coef=1.0))
    assert torch.allclose(only.tokens, torch.tensor([[v] * 6 for v in (S, -S, -S, S)]))
    merged = mt_grpo_advantages(R_T, R_O, ROWS, AdvantageSettings.of("merged", 2, turn_advantage_coef=1.0))  # R_T + R_O: (1.5, 0) and (1, 3)
    assert torch.allclose(merged.tokens, torch.tensor([[v] * 6 for v in (S, -S, -S, S)]))


def test_local_rows_of_a_process():
    # process 1 of 2 holds samples 2-3: its tokens, advantages normalised over the whole batch
    adv = mt_grpo_advantages(R_T, R_O, ROWS[2:], AdvantageSettings.of("mt_grpo", 2, turn_advantage_coef=1.0), local=slice(2, 4))
    assert torch.allclose(adv.tokens, torch.tensor([[-S] * 6, [S] * 6]))


def test_groups_without_signal_are_marked():
    R = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv = mt_grpo_advantages(torch.zeros(4), R, ROWS, AdvantageSettings.of("mt_grpo", 2, turn_advantage_coef=1.0))
    assert adv.informative.tolist() == [False, False, True, True]
    assert adv.tokens[:2].abs().sum() == 0


@pytest.mark.parametrize("scale, expected", [
    ("group", [-S, S, -S, S]),
    ("none", [-0.5, 0.5, -2.0, 2.0]),
    # batch std of (0, 1, 0, 4): mean 1.25, sqrt((1.25^2 * 2 + 0.25^2 + 2.75^2) / 3) = sqrt(43/12)
    ("batch", [v / math.sqrt(43 / 12) for v in (-0.5, 0.5, -2.0, 2.0)]),
])
def test_scale_rewards_as_trl_defines_it(scale, expected):
    adv = group_normalize(torch.tensor([0.0, 1.0, 0.0, 4.0]), 2, scale)
    assert adv.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_zero_under_every_scale(scale):
    assert group_normalize(torch.tensor([0.1, 0.1, 0.7, 0.7]), 2, scale).tolist() == [0.0] * 4


def test_end_to_end_group_of_four_by_hand():
    # One group: turn rewards from tool use, outcome rewards from the answer.
    R_T = torch.tensor([0.7, 0.7, 0.2, 0.0])
    R_O = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rows = turns(*[[Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3)]] * 3, [Span("model", 0, 3)], length=3)
    adv = mt_grpo_advantages(R_T, R_O, rows, AdvantageSettings.of("mt_grpo", 4, turn_advantage_coef=1.0))
    assert adv.outcome.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])  # mean .25, sample std .5
    mean_t = 0.4
    std_t = math.sqrt(((0.3) ** 2 * 2 + 0.2**2 + 0.4**2) / 3)
    A_T = [(r - mean_t) / std_t for r in R_T.tolist()]
    assert adv.turn[:, 0].tolist() == pytest.approx(A_T)
    assert adv.tokens[0].tolist() == pytest.approx([1.5 + A_T[0], 1.5, 1.5])
    assert adv.tokens[3].tolist() == pytest.approx([-0.5 + A_T[3]] * 3)


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


def test_reward_values_trl_takes_are_taken_as_trl_takes_them():
    """TRL turns a reward's list into `torch.tensor(values, dtype=float32)`: bools, numpy numbers and one-element
    tensors train there, so here too, with the same values; a list inside the list does not."""
    import numpy as np

    values = [True, False, np.float32(0.5), np.int64(2), torch.tensor(0.25), 3]

    def trl_style(prompts, completions, **kwargs):
        return values

    out = compute_rewards_per_func([trl_style], ["p"] * 6, [[]] * 6, {})
    assert out[:, 0].tolist() == torch.tensor(values, dtype=torch.float32).tolist() == [1.0, 0.0, 0.5, 2.0, 0.25, 3.0]

    def as_array(prompts, completions, **kwargs):  # the whole list as a numpy array or a tensor
        return as_array.kind([0.5, 1.0])

    for as_array.kind in (np.array, torch.tensor):
        assert compute_rewards_per_func([as_array], ["p", "p"], [[], []], {})[:, 0].tolist() == [0.5, 1.0]

    def nested(prompts, completions, **kwargs):
        return [[1.0], [0.0]]

    with pytest.raises(ValueError, match=r"'nested' returned \[1.0\] for sample 0: rewards must be finite numbers"):
        compute_rewards_per_func([nested], ["p", "p"], [[], []], {})


@pytest.mark.parametrize("returned, message", [
    (1.0, "'lone_reward' returned float 1.0, not a list: return a list of 2 values, one per sample"),
    ([1.0], "'lone_reward' returned 1 values for 2 samples: return one value per completion"),
])
def test_reward_function_returning_no_list_or_the_wrong_count_is_named(returned, message):
    def lone_reward(prompts, completions, **kwargs):
        return returned

    with pytest.raises(ValueError) as info:
        compute_rewards_per_func([lone_reward], ["p", "p"], [[], []], {})
    assert message in str(info.value)


def test_reward_function_without_kwargs_is_refused_at_start_with_the_keywords_it_lacks():
    def strict(prompts, completions):  # TRL passes every column and its own keywords: this one would raise
        return [0.0 for _ in completions]

    def takes_all(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, stop_reason, question):
        return [0.0 for _ in completions]

    with pytest.raises(ValueError) as info:
        check_reward_columns([strict], ["prompt", "question"], environments=False)
    assert str(info.value).startswith("Reward function 'strict' takes no `**kwargs`")
    assert "['question', 'completion_ids', 'trainer_state', 'log_extra', 'log_metric', 'stop_reason']" in str(info.value)
    assert "end its signature with `**kwargs`" in str(info.value)
    check_reward_columns([takes_all], ["prompt", "question"], environments=False)  # names every keyword: accepted
    with pytest.raises(ValueError, match=r"would be passed \['environments'\]"):
        check_reward_columns([takes_all], ["prompt", "question"], environments=True)


def test_reward_function_that_raises_is_named_with_the_failing_sample():
    def picky_reward(prompts, completions, answer, **kwargs):
        return [1.0 / len(a) for a in answer]  # ZeroDivisionError on an empty alias list

    with pytest.raises(RuntimeError, match=r"'picky_reward' raised on sample 2: ZeroDivisionError"):
        compute_rewards_per_func([picky_reward], ["p"] * 3, [[]] * 3, {"answer": [["a"], ["b"], []]})


TRAINER = torch.tensor([[0.0, 0.0, -1.0], [0.0, -1.0, 0.0]])
SAMPLER = torch.tensor([[0.0, -5.0, 0.0], [0.0, 0.0, float("nan")]])  # ratios (1, e^5, e^-1), (1, e^-1, ?)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
E = math.e


@pytest.mark.parametrize("mode, clip_min, clip_max, expected", [
    ("token_truncate", None, 2.0, [[1.0, 2.0, 1.0], [1.0, 1 / E, 1.0]]),  # off-mask and NaN: 1
    ("token_truncate", 0.5, 2.0, [[1.0, 2.0, 1.0], [1.0, 0.5, 1.0]]),
    ("token_mask", None, 2.0, [[1.0, 0.0, 1.0], [1.0, 1 / E, 1.0]]),
    ("token_mask", 0.5, 3.0, [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
    # sequence: the product over model tokens: e^5 and e^-1
    ("sequence_truncate", None, 3.0, [[3.0, 3.0, 1.0], [1 / E] * 3]),
    ("sequence_mask", None, 3.0, [[0.0, 0.0, 1.0], [1 / E] * 3]),
    ("sequence_mask", 0.5, 3.0, [[0.0, 0.0, 1.0], [0.0] * 3]),
])
def test_importance_weights_in_every_trl_mode(mode, clip_min, clip_max, expected):
    w = importance_weights(TRAINER, SAMPLER, MASK, mode, clip_min, clip_max)
    assert torch.allclose(w, torch.tensor(expected))


def probe(*values):
    return torch.tensor(values)


@pytest.mark.parametrize("ours, reference, theirs, noise, verdict, verified", [
    (probe(-1.0, -2.0), probe(-1.0, -2.0), probe(-1.0, -2.0), 0.0, "", True),  # first sync: reference is ours
    (probe(-1.5, -2.5), probe(-1.0, -2.0), probe(-1.5, -2.5), 0.0, "", True),  # fresh
    (probe(-1.5, -2.5), probe(-1.0, -2.0), probe(-1.0, -2.0), 0.0, "stale weights", False),  # kept the old ones
    (probe(-1.0, -2.0), probe(-1.0, -2.0), probe(-1.4, -2.0), 0.0, "differ from the trainer's by up to 0.4", False),
    # the policy moved less than the noise: not judged for staleness, not a new reference
    (probe(-1.0, -2.0001), probe(-1.0, -2.0), probe(-1.02, -2.0), 0.02, "", False),
])
def test_probe_verdict(ours, reference, theirs, noise, verdict, verified):
    if verdict == "" and ours is not reference and torch.equal(ours, reference):
        reference = ours  # the first sync passes the same tensor
    error, metrics, ok = probe_verdict(ours, reference, theirs, noise, tolerance=0.1)
    assert (verdict in error) and (bool(error) == bool(verdict))
    assert ok == verified
    assert metrics["sync/probe_max_abs_logprob_diff"] == pytest.approx((theirs - ours).abs().max().item())


# ---- per_turn: one group of four, up to two tool turns each (NaN: no such turn, or a None reward)
#   s0: two tool turns, R_T (0.2, 0.5), R_O 1      s1: one tool turn, R_T (0.0, -), R_O 0
#   s2: no tool call,   R_T (-, -),     R_O 0      s3: two tool turns, R_T (None, 0.1), R_O 1
PT_R_T = torch.tensor([[0.2, 0.5], [0.0, NAN], [NAN, NAN], [NAN, 0.1]])
PT_R_O = torch.tensor([1.0, 0.0, 0.0, 1.0])
PT_ROWS = turns([Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3), Span("env", 3, 4), Span("model", 4, 5)],
                [Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3)],
                [Span("model", 0, 2)],
                [Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3), Span("env", 3, 4), Span("model", 4, 5)],
                length=5)
A_O4 = 0.5 / math.sqrt(1 / 3)  # R_O mean 0.5, sample std sqrt(4 * 0.25 / 3)
# pooled over the group's four valid (sample, turn) values 0.2 0.5 0.0 0.1: mean 0.2, sample std sqrt(0.14 / 3)
P = math.sqrt(0.14 / 3)
POOLED = [[0.0, 0.3 / P], [-0.2 / P, 0.0], [0.0, 0.0], [0.0, -0.1 / P]]
# by turn index: turn 0 over s0, s1 (0.2, 0.0); turn 1 over s0, s3 (0.5, 0.1): each +-1/sqrt(2)
BY_INDEX = [[S, S], [-S, 0.0], [0.0, 0.0], [0.0, -S]]


@pytest.mark.parametrize("normalization, A_T", [("pooled", POOLED), ("by_turn_index", BY_INDEX)])
def test_per_turn_credit_by_hand(normalization, A_T):
    adv = mt_grpo_advantages(PT_R_T, PT_R_O, PT_ROWS, AdvantageSettings.of("per_turn", 4, turn_advantage_coef=0.5, turn_normalization=normalization))
    assert torch.allclose(adv.turn, torch.tensor(A_T), atol=1e-6)
    A_O = [A_O4, -A_O4, -A_O4, A_O4]
    env = None  # env tokens: A_O (masked in the loss anyway)
    expected = [
        [A_O[0] + 0.5 * A_T[0][0], env, A_O[0] + 0.5 * A_T[0][1], env, A_O[0]],  # the answer turn gets A_O
        [A_O[1] + 0.5 * A_T[1][0], env, A_O[1], A_O[1], A_O[1]],  # padded after its answer
        [A_O[2]] * 5,  # no tool call: all of it is the final turn
        [A_O[3] + 0.5 * A_T[3][0], env, A_O[3] + 0.5 * A_T[3][1], env, A_O[3]],
    ]
    for row, values in zip(adv.tokens.tolist(), expected):
        for got, want in zip(row, values):
            if want is not None:
                assert got == pytest.approx(want, abs=1e-6)


def test_per_turn_discount_adds_the_later_turns_credit():
    g = 0.5
    adv = mt_grpo_advantages(PT_R_T, PT_R_O, PT_ROWS, AdvantageSettings.of("per_turn", 4, turn_advantage_coef=1.0, turn_credit_discount=g))
    A = POOLED
    assert adv.tokens[0, 0].item() == pytest.approx(A_O4 + A[0][0] + g * A[0][1])
    assert adv.tokens[0, 2].item() == pytest.approx(A_O4 + A[0][1])  # the last tool turn: its own credit
    assert adv.tokens[0, 4].item() == pytest.approx(A_O4)  # the answer turn
    assert adv.tokens[3, 0].item() == pytest.approx(A_O4 + 0.0 + g * A[3][1])  # a None reward credits 0 itself


def test_per_turn_rewards_fill_one_column_per_tool_turn():
    from mt_grpo.rewards import per_tool_turn

    @per_tool_turn
    def each_turn(prompts, completions, **kwargs):
        return [[0.5] * n for n in (2, 1, 0)]

    def first_turn(prompts, completions, **kwargs):
        return [1.0, None, 0.0]

    out = compute_rewards_per_func([each_turn, first_turn], ["p"] * 3, [[]] * 3, {}, tool_turns=[2, 1, 0], max_turns=2)
    assert out.shape == (3, 2, 2)
    assert out[:, 0].tolist()[0] == [0.5, 0.5] and out[1, 0, 0] == 0.5 and torch.isnan(out[1, 0, 1])
    assert torch.isnan(out[2, 0]).all()
    assert out[0, 1, 0] == 1.0 and torch.isnan(out[0, 1, 1]) and torch.isnan(out[1, 1]).all()


def test_a_per_turn_reward_of_the_wrong_length_or_in_the_outcome_rewards_is_an_error():
    from reward_examples import one_value_too_many

    with pytest.raises(ValueError, match=r"'one_value_too_many' returned \[1.0, 1.0, 1.0\] for sample 0, which has 1 tool turns"):
        compute_rewards_per_func([one_value_too_many], ["p"], [[{"role": "assistant", "content": "x", "tool_calls": []},
                                                               {"role": "tool", "name": "s", "content": "r"}]],
                                 {}, tool_turns=[1], max_turns=2)
    with pytest.raises(ValueError, match="list it in `turn_reward_funcs`"):
        compute_rewards_per_func([one_value_too_many], ["p"], [[]], {})


# ---- per_turn: an episode without a tool turn still has a turn 0 (turn_reward_table)
#   functions: f0 per-turn (one value per tool turn), f1 per-sample (one value per episode), weights 1 and 2
#   s0: two tool turns, f0 (0.5, 0.2), f1 1.0      s1: one tool turn, f0 (0.5,), f1 0.0
#   s2: no tool turn,   f0 [],         f1 0.0      s3: no tool turn, f0 [], f1 None
def test_per_turn_table_gives_an_episode_without_a_tool_turn_its_first_turn():
    per_func = torch.tensor([[[0.5, 0.2], [1.0, NAN]],
                             [[0.5, NAN], [0.0, NAN]],
                             [[NAN, NAN], [0.0, NAN]],
                             [[NAN, NAN], [NAN, NAN]]])
    R_T = turn_reward_table(per_func, torch.tensor([1.0, 2.0]), torch.tensor([2, 1, 0, 0]), [True, False])
    expected = [[0.5 + 2.0, 0.2], [0.5, NAN], [0.0, NAN], [0.0, NAN]]  # s2, s3: f0 gives 0 to a turn without a call
    assert torch.allclose(R_T, torch.tensor(expected), equal_nan=True)


def test_per_turn_credit_reaches_an_episode_that_never_searched():
    """One group: s0 searched and found (R_T(0) 0.7), s1 searched and missed (0.2), s2 and s3 answered at once
    (turn 0 earns 0). Pooled A_T(0) over 0.7 0.2 0 0 (mean 0.225, sample std sqrt(0.3275 / 3)); the
    no-search answers get A_O + A_T(0) on all their tokens, a negative credit: the pressure to search."""
    R_T = torch.tensor([[0.7, NAN], [0.2, NAN], [0.0, NAN], [0.0, NAN]])
    R_O = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rows = turns([Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3)],
                 [Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3)],
                 [Span("model", 0, 3)], [Span("model", 0, 3)], length=3)
    adv = mt_grpo_advantages(R_T, R_O, rows, AdvantageSettings.of("per_turn", 4, turn_advantage_coef=1.0))
    std = math.sqrt(0.3275 / 3)
    A_T0 = [(r - 0.225) / std for r in (0.7, 0.2, 0.0, 0.0)]
    A_O = [0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5]  # R_O mean 0.25, sample std sqrt(0.75 / 3) = 0.5
    assert adv.tokens[2].tolist() == pytest.approx([A_O[2] + A_T0[2]] * 3, abs=1e-5)
    assert A_T0[2] < 0
    assert adv.tokens[0, 0].item() == pytest.approx(A_O[0] + A_T0[0], abs=1e-5)  # the searching turn
    assert adv.tokens[0, 2].item() == pytest.approx(A_O[0], abs=1e-5)  # its answer turn: A_O


# ---- mt_grpo with a @per_tool_turn turn reward: the same turn-0 rule, one column (K = 1)
def test_mt_grpo_with_a_per_turn_reward_credits_the_first_turn_of_an_episode_that_never_searched():
    """One group, R_O all 0 (A_O = 0), one per-turn turn reward: s0 (tool turns 0.5 then 0.2) and s1 (0.5) searched,
    s2 and s3 answered at once. mt_grpo reads the first tool turn: R_T 0.5 0.5, and 0 0 for the turns that called
    nothing (mean 0.25, sample std sqrt(0.25 / 3)): A_T = +-0.25 / sqrt(1 / 12) = +-sqrt(3) / 2 on each first
    turn. Left NaN, the no-search answers would leave the group's statistics, the two equal searches would give
    A_T = 0, and the group would have no signal at all."""
    from mt_grpo.rewards import per_tool_turn

    @per_tool_turn
    def found(prompts, completions, **kwargs):
        return [[0.5, 0.2], [0.5], [], []]

    tool_turns = [2, 1, 0, 0]
    per_func = compute_rewards_per_func([found], ["p"] * 4, [[]] * 4, {}, tool_turns=tool_turns, max_turns=1)
    R_T = turn_reward_table(per_func, torch.tensor([1.0]), torch.tensor(tool_turns), [True])
    assert R_T.tolist() == [[0.5], [0.5], [0.0], [0.0]]
    rows = turns([Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 3), Span("env", 3, 4), Span("model", 4, 5)],
                 [Span("model", 0, 1), Span("env", 1, 2), Span("model", 2, 5)],
                 [Span("model", 0, 5)], [Span("model", 0, 5)], length=5)
    adv = mt_grpo_advantages(R_T, torch.zeros(4), rows, AdvantageSettings.of("mt_grpo", 4, turn_advantage_coef=1.0))
    a = math.sqrt(3) / 2
    assert adv.turn[:, 0].tolist() == pytest.approx([a, a, -a, -a])
    assert torch.allclose(adv.tokens, torch.tensor([[a, 0, 0, 0, 0], [a, 0, 0, 0, 0], [-a] * 5, [-a] * 5]))
    assert adv.informative.tolist() == [True] * 4
    without_the_rule = weighted_reward(per_func, torch.tensor([1.0]))  # (4, 1): 0.5 0.5 NaN NaN
    without = mt_grpo_advantages(without_the_rule, torch.zeros(4), rows, AdvantageSettings.of("mt_grpo", 4, turn_advantage_coef=1.0))
    assert without.informative.tolist() == [False] * 4 and without.tokens.abs().sum() == 0


@pytest.mark.parametrize("loss_type, expected", [
    # generation batch (all processes): 20 loss tokens, 5 of them informative; 8 rows, 2 of them informative
    ("grpo", 8 / 2), ("dr_grpo", 8 / 2), ("luspo", 8 / 2), ("sapo", 8 / 2),
    ("dapo", 20 / 5), ("cispo", 20 / 5), ("vespo", 20 / 5),
])
def test_zero_signal_scale_by_loss_type(loss_type, expected):
    scale = zero_signal_scale(loss_type, torch.tensor(20), torch.tensor(5), torch.tensor(8), torch.tensor(2))
    assert scale.shape == () and scale.item() == pytest.approx(expected)


def test_zero_signal_scale_without_signal_is_one_and_a_layout_dependent_loss_is_refused():
    assert zero_signal_scale("grpo", torch.tensor(4), torch.tensor(0), torch.tensor(2), torch.tensor(0)).item() == 1.0
    for loss_type in ("bnpo", "new_loss"):  # bnpo: each micro-batch's own token count, no one factor fits
        with pytest.raises(ValueError, match="mask_zero_advantage_groups: false"):
            zero_signal_scale(loss_type, torch.tensor(4), torch.tensor(4), torch.tensor(2), torch.tensor(2))


# ---- a new advantage mode is one function and one entry of ADVANTAGE_MODES
def turn_only_credit(R_T, R_O, A_O, s):
    """A test's mode: no outcome advantage; A_T on the tokens before the first tool result."""
    A_T = s.normalize(R_T[:, 0])[:, None]
    return torch.zeros_like(A_O), A_T, torch.cat([A_T, torch.zeros_like(A_T)], dim=1)


def test_a_mode_added_by_one_function_and_one_entry(monkeypatch):
    monkeypatch.setitem(ADVANTAGE_MODES, "turn_only", AdvantageMode(turn_only_credit, "A_T alone"))
    R_T, R_O = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    turns = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1], [0, 1, 1, -1], [0, 0, 0, 0]])
    adv = mt_grpo_advantages(R_T, R_O, turns, AdvantageSettings.of("turn_only", 4, turn_advantage_coef=0.5))
    a = 1 / math.sqrt(1 / 3)  # A_T of R_T = (1, 0, 1, 0): +-0.5 / std 0.577
    expected = 0.5 * (turns == 0).float() * torch.tensor([0.5, -0.5, 0.5, -0.5])[:, None] * a
    assert torch.allclose(adv.tokens, expected, atol=1e-6)
    assert adv.informative.all() and torch.allclose(adv.outcome.abs(), torch.full((4,), 0.5 * a), atol=1e-6)
    # `auto` never picks an entry without a condition; an unknown mode names the table's
    assert resolve_advantage_mode("auto", turn_rewards=True, step_rewards=False) == "mt_grpo"
    with pytest.raises(ValueError, match="turn_only"):
        mt_grpo_advantages(R_T, R_O, turns, AdvantageSettings.of("no_such_mode", 4, turn_advantage_coef=1.0))


ADD_A_MODE = """
import sys, torch
import mt_grpo_trainer as mt
sys.path.insert(0, "tests")
from test_advantages import turn_only_credit
mt.ADVANTAGE_MODES["turn_only"] = mt.AdvantageMode(turn_only_credit, "A_T alone", credits_turns=True)
mt.main(sys.argv[1:])
"""


def train_one_step(script: str, tiny_agent_dir: str, tmp_path, *flags) -> str:
    """One step of the tiny recipe, run by `script` (a table extended, then mt.main), its rollouts recorded; the
    output folder, after checking that the step trained."""
    import sys

    from helpers import RECIPE, final_metrics, run

    out = str(tmp_path / "out")
    run([sys.executable, "-c", script, "--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir", out,
         "--save_strategy", "no", "--max_steps", "1", "--eval_strategy", "no", "--per_device_train_batch_size", "4",
         "--max_samples", "4", "--save_rollouts_steps", "1", *flags], tmp_path)
    (step,) = [h for h in final_metrics(out) if "loss" in h]
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
    return out


def test_the_trainer_trains_with_an_added_mode(tiny_agent_dir, tmp_path):
    """The recipe's field takes the new mode (its choices are the table's), and a step trains with it: every
    recorded token advantage is coef * A_T on turn 0 and 0 elsewhere."""
    from helpers import rollout_records

    out = train_one_step(ADD_A_MODE, tiny_agent_dir, tmp_path, "--advantage_mode", "turn_only",
                         "--turn_advantage_coef", "0.5")
    for record in rollout_records(out):
        A_T, tokens = record["A_T"], record["tokens"]
        first = record["first_result"]
        for k, (a, m) in enumerate(zip(tokens["advantage"], tokens["model_mask"])):
            want = 0.5 * (A_T[0] if isinstance(A_T, list) else A_T) if k < first else 0.0
            assert a == pytest.approx(want, abs=1e-5), (k, a, want)


# ---- a mode with its own knob: one config field, read through AdvantageSettings.config, one function, one entry
ADD_A_KNOB = """
import dataclasses, sys
import torch
import mt_grpo_trainer as mt
from mt_grpo.base.fields import arg


def outcome_scaled_credit(R_T, R_O, A_O, s):
    A_T = s.normalize(R_T[:, 0])[:, None]
    return s.config.outcome_scale * A_O, A_T, torch.zeros(len(A_O), 2)


@dataclasses.dataclass
class Config(mt.MTGRPOConfig):  # a fork adds the field to section 1's MTGRPOScriptArguments
    outcome_scale: float = arg(1.0, "outcome_scaled: the factor on A_O.")


mt.MTGRPOConfig = Config
mt.ADVANTAGE_MODES["outcome_scaled"] = mt.AdvantageMode(outcome_scaled_credit, "A_O times outcome_scale")
mt.main(sys.argv[1:])
"""


def test_a_mode_with_its_own_knob_is_a_field_a_function_and_an_entry(tiny_agent_dir, tmp_path):
    """The knob is a recipe flag like any field, and the mode reads it from the settings the trainer built once:
    every model token's recorded advantage is outcome_scale x A_O."""
    from helpers import rollout_records

    out = train_one_step(ADD_A_KNOB, tiny_agent_dir, tmp_path, "--advantage_mode", "outcome_scaled",
                         "--outcome_scale", "3")
    records = rollout_records(out)
    assert records and any(r["A_O"] != 0 for r in records)
    for record in records:
        model = [a for a, m in zip(record["tokens"]["advantage"], record["tokens"]["model_mask"]) if m]
        assert model and model == pytest.approx([3 * record["A_O"]] * len(model), abs=1e-5)


def test_advantage_settings_read_the_knobs_by_name():
    s = AdvantageSettings.of("per_turn", 2, turn_credit_discount=0.5, scale_rewards="none")
    assert (s.config.turn_credit_discount, s.config.turn_normalization, s.config.turn_advantage_coef) == (0.5, "pooled",
                                                                                                          1.0)
    assert s.normalize(torch.tensor([1.0, 3.0])).tolist() == [-1.0, 1.0]  # scale none: centred only
