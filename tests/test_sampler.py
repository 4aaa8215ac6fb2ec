"""Importance weights are 1 on-policy under every sampler setting: the trainer scores sampled tokens
under the same processing the sampler applied (`sampler_logprobs`: repetition penalty, temperature,
min_p, top-k, top-p, in vLLM's order). By hand on small vocabularies, then with the in-process backend
on the tiny model over the whole grid of settings (the live vLLM server's half is in test_vllm_server.py)."""

import math

import pytest
import torch
from accelerate import Accelerator

from helpers import SAMPLER_GRID, on_policy_weights, sampler_id
from mt_grpo_trainer import SamplingParams, TransformersBackend, sampler_logprobs, seen_tokens
from weight_sync import sampler_probe_verdict



def probs(logits, **params):
    return sampler_logprobs(torch.tensor([logits]), SamplingParams(**params)).exp()[0].tolist()


def test_temperature_alone_is_the_softmax_at_the_temperature():
    x = torch.tensor([[1.0, 2.0, 0.5]])
    assert torch.allclose(sampler_logprobs(x, SamplingParams(temperature=0.5)), (x / 0.5).log_softmax(-1))
    assert torch.allclose(sampler_logprobs(x, SamplingParams(temperature=0.0)), x.log_softmax(-1))  # greedy: T 1


def test_top_k_keeps_ties_with_the_kth():
    assert probs([3.0, 1.0, 1.0, 0.0], top_k=2) == pytest.approx([math.e**2 / (math.e**2 + 2), 1 / (math.e**2 + 2),
                                                                  1 / (math.e**2 + 2), 0.0])


def test_top_p_drops_a_token_once_the_mass_above_it_reaches_top_p():
    # probabilities 0.5 0.3 0.2: top_p 0.8 keeps 0.5 and 0.3 (mass above the 0.2 token is 0.8)
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    assert probs(logits, top_p=0.8) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0])
    assert probs(logits, top_p=0.81) == pytest.approx([0.5, 0.3, 0.2])
    assert probs(logits, top_p=0.1) == pytest.approx([1.0, 0.0, 0.0])  # the most likely is always kept


def test_min_p_is_relative_to_the_most_likely_token_before_top_k():
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    assert probs(logits, min_p=0.5) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0])  # 0.2 < 0.5 * 0.5
    # vLLM's order: min_p on the full distribution, then top-k (transformers applies min_p last)
    assert probs(logits, min_p=0.7, top_k=2) == pytest.approx([1.0, 0.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    x, seen = torch.tensor([[2.0, -1.0, 1.0]]), torch.tensor([[True, True, False]])
    got = sampler_logprobs(x, SamplingParams(repetition_penalty=2.0), seen)
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 1.0]]).log_softmax(-1))


def test_seen_tokens_are_those_before_each_position():
    assert seen_tokens(torch.tensor([2, 0, 2, 1]), 3).tolist() == [
        [False, False, False], [False, False, True], [True, False, True], [True, False, True]]


def test_sampler_probe_verdict():
    processed, raw = torch.tensor([-0.1, -0.5]), torch.tensor([-0.4, -1.2])
    assert sampler_probe_verdict(processed + 1e-4, processed, raw, 1e-3)[0] == ""
    assert "--logprobs-mode processed_logprobs" in sampler_probe_verdict(raw, processed, raw, 1e-3)[0]
    assert "differ from the trainer's" in sampler_probe_verdict(processed - 0.2, processed, processed - 1.0, 1e-3)[0]


@pytest.mark.parametrize("settings", SAMPLER_GRID, ids=sampler_id)
def test_in_process_importance_weights_are_one_on_policy(agent, settings):
    """Two prompts of different lengths (left padding), 3 samples each, 40 tokens: every token's weight and
    every sequence's weight is 1. Without the processing (the softmax at the temperature alone), truncating
    settings give sequence weights well below 1: the test can tell."""
    model, tokenizer, ids = agent
    params = SamplingParams(**settings)
    backend = TransformersBackend(tokenizer=tokenizer, params=params, eos_token_ids=[tokenizer.eos_token_id],
                                  stop_strings=[])
    backend.sync_weights(model, Accelerator(cpu=True))
    prompts = [ids, ids[:-5] + ids[-3:]]
    torch.manual_seed(0)
    samples = backend.generate(prompts, [40, 40], n=3)
    for mode in ("token_truncate", "sequence_truncate"):
        weights = on_policy_weights(model, prompts, samples, params, mode)
        assert torch.allclose(weights, torch.ones_like(weights), atol=1e-4), mode
    if params.truncates:
        plain = SamplingParams(temperature=params.temperature)
        untruncated = on_policy_weights(model, prompts, samples, plain, "sequence_truncate")
        assert untruncated[:, 0].min() < 0.99
