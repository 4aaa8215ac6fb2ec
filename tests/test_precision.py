"""The trainer under mixed precision, as the GPU recipes run it: the forward under autocast, float32 master
weights. bf16 autocast runs here on the CPU; fp16 autocast with accelerate's loss scaler needs CUDA (accelerate
refuses it on a CPU, and checks.check_precision says so at start), so its test runs only where a GPU is."""

import math

import pytest
import torch

from helpers import changed_parameters, smoke_run


def check_trained(model_dir, out, steps):
    assert len(steps) == 2
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in steps), steps
    assert changed_parameters(model_dir, out), "no parameter changed after 2 optimizer steps"


def test_bf16_autocast_trains_two_steps_on_cpu(tiny_agent_dir, tmp_path):
    """The GPU recipes' bf16 (TRL's default), with old log-probs and the reference model: every CPU recipe and test
    otherwise sets `bf16: false`."""
    out, _, steps = smoke_run(tiny_agent_dir, tmp_path, "--bf16", "true", "--num_iterations", "2", "--beta", "0.02")
    check_trained(tiny_agent_dir, out, steps)
    # step 1 is on-policy: the reference model is the policy, scored under the same autocast, so the KL is 0
    # exactly (a reference outside autocast would read bf16's rounding here); step 2 follows an update
    assert steps[0]["kl"] == 0 and steps[1]["kl"] > 0, steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 autocast with a loss scaler needs CUDA")
def test_fp16_autocast_trains_two_steps_on_a_gpu(tiny_agent_dir, tmp_path):
    out, _, steps = smoke_run(tiny_agent_dir, tmp_path, "--use_cpu", "false", "--bf16", "false", "--fp16", "true",
                              "--num_iterations", "2", "--beta", "0.02")
    check_trained(tiny_agent_dir, out, steps)
    assert steps[0]["kl"] == 0 and steps[1]["kl"] > 0, steps
