"""What a step costs, beyond its values: TRL's fused LM head scores only the labelled (completion) positions on
CPU too, with the values and gradients of scoring every position."""

import torch
import trl.trainer.utils as trl_utils
from transformers import AutoModelForCausalLM
from trl.kernels.chunked_logprob import _use_triton as trl_use_triton
from trl.trainer.utils import add_fused_lm_head

from mt_grpo_trainer import score_labelled_tokens_only


def test_cpu_scores_the_labelled_positions_only_with_the_same_values_and_gradients(tiny_agent_dir, monkeypatch):
    # TRL's own switch (a trainer built earlier in this process patched it), restored after the test
    monkeypatch.setattr(trl_utils, "_use_triton", trl_use_triton)
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :30] = -100  # a prompt of 30 tokens: only the last 10 are scored
    labels[1, 35:] = -100  # and a shorter completion

    def score():
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        out.log_probs.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.log_probs.detach(), out.entropy.detach(), grads

    assert not trl_utils._use_triton(torch.device("cpu"))  # TRL's own choice: every position
    every = score()
    score_labelled_tokens_only()
    score_labelled_tokens_only()  # idempotent: patched once
    assert trl_utils._use_triton(torch.device("cpu")) and trl_utils._use_triton.cpu_too
    labelled = score()
    mask = labels[:, 1:] != -100
    torch.testing.assert_close(labelled[0][mask], every[0][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(labelled[1][mask], every[1][mask], atol=1e-5, rtol=0)
    assert (labelled[0][~mask] == 0).all()
    assert every[2].keys() == labelled[2].keys() and len(every[2]) > 0
    for name in every[2]:
        torch.testing.assert_close(labelled[2][name], every[2][name], atol=1e-5, rtol=1e-4)
