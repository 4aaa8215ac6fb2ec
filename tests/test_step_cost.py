"""What a step costs, beyond its values: TRL's fused LM head scores only the labelled (completion) positions on
CPU too, with the values and gradients of scoring every position."""

import torch
import trl.trainer.utils as trl_utils
from transformers import AutoModelForCausalLM
from trl.kernels.chunked_logprob import _use_triton as trl_use_triton
from trl.trainer.utils import add_fused_lm_head

from mt_grpo.engine.packing import score_labelled_tokens_only


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


def test_cpu_narrows_the_lm_heads_vocabulary_tiles_with_the_same_values_and_gradients(monkeypatch):
    """TRL's 32,768-column tiles hold ~1.5 GiB of temporaries in its torch fallback for a demo step's completion
    (studies/lm_head_tiles.py); on CPU the trainer asks for CPU_LM_HEAD_TILE columns, with TRL's own kernel."""
    from types import SimpleNamespace

    from mt_grpo.engine.packing import CPU_LM_HEAD_TILE
    from trl.kernels import ChunkedLogProbFunction

    asked = []
    spy = SimpleNamespace(apply=lambda *a: asked.append(a[5]) or ChunkedLogProbFunction.apply(*a))
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", spy)  # TRL's, as before any trainer patched it
    score_labelled_tokens_only()
    score_labelled_tokens_only()  # idempotent: wrapped once
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(3 * CPU_LM_HEAD_TILE + 5, 16, generator=g), torch.randn(20, 16, generator=g)
    targets = torch.randint(0, weight.shape[0], (20,), generator=g)

    def score(apply):
        w, h = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
        log_probs, entropy, *_ = apply(h, w, None, targets, 0.7, 32768, None, 1.0, ("log_probs", "entropy"))
        (log_probs.sum() + entropy.sum()).backward()
        return log_probs.detach(), entropy.detach(), w.grad, h.grad

    narrowed, wide = score(trl_utils._ChunkedLogProbFunction.apply), score(ChunkedLogProbFunction.apply)
    assert asked == [CPU_LM_HEAD_TILE] and trl_utils._ChunkedLogProbFunction.cpu_tiles
    for a, b in zip(narrowed, wide):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
