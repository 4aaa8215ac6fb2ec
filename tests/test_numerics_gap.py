"""The importance weights under a real numerics gap between sampler and trainer, as on a GPU (vLLM's bf16
kernels are not the trainer's): SmolLM2-135M samples in float32 through the in-process backend (the
sampler), and a bf16 copy of the same weights scores the samples with `policy_sampler_logprobs` (the
trainer). Under top-p 0.8 / top-k 20 a sampled token at the edge of the kept set may fall outside the
bf16 scorer's own set; it must still get a finite logprob near the sampler's, not the -inf that zeroes the
episode's sequence weight."""

import pytest
import torch
from accelerate import Accelerator

from helpers import on_policy_weights
from mt_grpo_trainer import SamplingParams, TransformersBackend, sampler_logprobs

QUESTIONS = ["What is the capital of France?", "Name a famous painter and one of his works.",
             "Describe how a bicycle works.", "Why is the sky blue?", "Tell me about the history of tea.",
             "What do cats eat?", "Explain what a search engine does.", "Write a short poem about rain."]
EPISODE_TOKENS, PER_PROMPT = 64, 4


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(float32 model, bf16 copy, tokenizer, 8 prompts) of SmolLM2-135M-Instruct (conftest.smollm2_dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scorer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    return model, scorer, tokenizer, prompts


def sample_and_score(smollm2, params: SamplingParams):
    """32 episodes (8 prompts x 4) of up to 64 tokens sampled in float32: their sequence_mask weights (clip
    0.5-2.0, TRL's bounds for the mask: 0 outside) from the bf16 trainer's logprobs, and the logits of each
    episode's forward in that scoring (policy_sampler_logprobs scores one episode per forward, in order): the
    test reads them rather than forwarding every episode again (bf16 on a CPU without bf16 instructions is slow)."""
    model, scorer, tokenizer, prompts = smollm2
    backend = TransformersBackend(tokenizer=tokenizer, params=params, eos_token_ids=[tokenizer.eos_token_id],
                                  stop_strings=[])
    backend.sync_weights(model, Accelerator(cpu=True))
    torch.manual_seed(0)
    samples = backend.generate(prompts, [EPISODE_TOKENS] * len(prompts), n=PER_PROMPT)
    logits = []
    hook = scorer.register_forward_hook(lambda module, args, output: logits.append(output.logits[0]))
    try:
        weights = on_policy_weights(scorer, prompts, samples, params, "sequence_truncate")[:, 0]
    finally:
        hook.remove()
    assert len(logits) == len(samples)
    return samples, weights, logits


def test_a_bf16_trainer_drops_no_token_a_float32_sampler_drew(smollm2):
    _, _, _, prompts = smollm2
    truncated = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
    samples, weights, forwards = sample_and_score(smollm2, truncated)
    assert len(samples) == 32 and sum(len(s.token_ids) for s in samples) / 32 > 40
    kept, own = [], []  # per drawn token: the bf16 trainer's logprob, and its logprob without the token kept
    for i, (sample, all_logits) in enumerate(zip(samples, forwards)):
        prompt, drawn = prompts[i // PER_PROMPT], torch.tensor(sample.token_ids)
        assert all_logits.shape[0] == len(prompt) + len(drawn)  # the forward of this episode
        logits = all_logits[len(prompt) - 1: -1].float()
        kept.append(sampler_logprobs(logits, truncated, keep=drawn).gather(1, drawn[:, None])[:, 0])
        own.append(sampler_logprobs(logits, truncated).gather(1, drawn[:, None])[:, 0])
        # within the bf16 gap of what the sampler reported
        assert (kept[-1] - torch.tensor(sample.logprobs)).abs().max() < 2.0
    kept, own = torch.cat(kept), torch.cat(own)
    # no drawn token is scored as dropped, though some lie outside the bf16 trainer's own kept set (so the
    # test can tell: scored that way, each would be -inf and zero its episode's sequence weight)
    assert torch.isfinite(kept).all() and torch.isinf(own).sum() > 0
    # Not compared here: the share of episodes below weight 0.5 against temperature alone. One seed of 32 episodes
    # cannot tell them apart (issue 60; the guide's "A token at the boundary" gives the held-out counts).
    print(f"tokens outside the bf16 set {int(torch.isinf(own).sum())} of {len(own)}; weights < 0.5: "
          f"{int((weights < 0.5).sum())} of 32; mean weight {weights.mean():.3f}")
