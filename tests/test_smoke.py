"""Run the trainer as a user does, in a subprocess, on a tiny random model: 2 optimizer steps.
Also the same on 2 CPU processes (torchrun, gloo), where ranks' episodes take different numbers of
turns. (`accelerate launch --cpu --num_processes 2` starts a single process: torchrun is the launcher
that really starts two.)"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "tests", "recipes", "tiny.yaml")


def launch(processes: int) -> list[str]:
    """The command prefix that starts `processes` ranks on CPU (the recipe has use_cpu: true)."""
    if processes == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]


def run(cmd, tmp_path, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    (tmp_path / "log.txt").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    return log


def final_metrics(output_dir):
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        return json.load(f)["log_history"]


def changed_parameters(model_dir, output_dir):
    before, after = load_file(os.path.join(model_dir, "model.safetensors")), load_file(os.path.join(output_dir, "model.safetensors"))
    return [k for k in before if not torch.equal(before[k], after[k])]


def smoke_run(model_dir, tmp_path, *flags):
    out = str(tmp_path / "out")
    log = run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", model_dir,
               "--output_dir", out, "--save_strategy", "no", *flags], tmp_path)
    return out, log, [h for h in final_metrics(out) if "loss" in h]


@pytest.fixture(scope="module")
def smoke_metrics(tiny_agent_dir, tmp_path_factory):
    """Every metric name a run logs (test_readme checks they are documented)."""
    _, _, steps = smoke_run(tiny_agent_dir, tmp_path_factory.mktemp("metrics"), "--max_steps", "1", "--beta", "0.01")
    return sorted(set(steps[0]) - {"step"})


@pytest.mark.parametrize("mode, flags", [
    ("mt_grpo", []),
    ("outcome_only", []),
    ("merged", ["--num_iterations", "2", "--beta", "0.02"]),  # old logprobs, the reference model and KL
])
def test_two_steps_train_and_log_the_metrics(tiny_agent_dir, tmp_path, mode, flags):
    out, log, steps = smoke_run(tiny_agent_dir, tmp_path, "--advantage_mode", mode, *flags)
    assert "step    2 |" in log  # the per-step line
    assert len(steps) == 2
    # a rollout at every step, except that num_iterations 2 trains twice on each rollout
    rollout_steps = steps[::2] if "--num_iterations" in flags else steps
    for key in ["rewards/turn/mean", "rewards/outcome/mean", "rewards/turn/tool_execution_reward_func",
                "rewards/outcome/exact_match_reward_func", "rollout/tool_calls_per_episode", "rollout/model_tokens",
                "completions/mean_length"]:
        assert all(key in h for h in rollout_steps), key
    assert all("clip_ratio/region_mean" in h for h in steps)
    if "--beta" in flags:
        assert all(h["kl"] >= 0 for h in steps)
    assert changed_parameters(tiny_agent_dir, out), "no parameter changed after 2 optimizer steps"


def test_two_processes(tiny_agent_dir, tmp_path):
    """2 ranks, gloo: each rank's episodes end after different numbers of turns (random policy),
    and nothing may hang on a collective inside the rollout."""
    out = str(tmp_path / "out")
    log = run([*launch(2), "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", tiny_agent_dir,
               "--output_dir", out, "--per_device_train_batch_size", "4"], tmp_path)
    assert "Training on 2 processes" in log
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2
    # episodes ended after different numbers of turns (a mean that is not a whole number)
    assert any(h["rollout/turns_per_episode"] % 1 for h in steps), [h["rollout/turns_per_episode"] for h in steps]
    assert changed_parameters(tiny_agent_dir, out)
