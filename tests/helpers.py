"""What test modules share for running the trainer as a user does: in a subprocess, from the
repository root, on the tiny recipe. conftest.py puts the repository root on sys.path and holds the
fixtures (`smoke_metrics` among them); test modules import these names with `from helpers import ...`."""

import json
import os
import subprocess
import sys

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
    # torch and safetensors here, not at the top: conftest imports this module for every test
    import torch
    from safetensors.torch import load_file

    before, after = load_file(os.path.join(model_dir, "model.safetensors")), load_file(os.path.join(output_dir, "model.safetensors"))
    return [k for k in before if not torch.equal(before[k], after[k])]


def smoke_run(model_dir, tmp_path, *flags):
    out = str(tmp_path / "out")
    log = run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", model_dir,
               "--output_dir", out, "--save_strategy", "no", *flags], tmp_path)
    return out, log, [h for h in final_metrics(out) if "loss" in h]


# temperature in {0.7, 1.0} x (top_p, top_k, min_p, repetition_penalty) each at its default and at a truncating value:
# SamplingParams(**settings) for settings in SAMPLER_GRID
SAMPLER_GRID = [dict(temperature=t, top_p=p, top_k=k, min_p=m, repetition_penalty=r)
                for t in (0.7, 1.0) for p in (1.0, 0.8) for k in (0, 20) for m in (0.0, 0.1) for r in (1.0, 1.3)]


def sampler_id(settings: dict) -> str:
    return "-".join(f"{k[:4]}{v}" for k, v in settings.items())


def on_policy_weights(model, prompts, samples, params, mode):
    """The trainer's importance weights for `samples` (prompt-major, as a backend's generate returns them):
    the padded batch scored by policy_sampler_logprobs against the sampler's logprobs. Returns (B, T) weights."""
    import torch
    from trl.trainer.utils import pad

    from mt_grpo_trainer import importance_weights, policy_sampler_logprobs

    per_prompt = len(samples) // len(prompts)
    rows = list(zip([p for p in prompts for _ in range(per_prompt)], samples))
    ones = lambda n: torch.ones(n, dtype=torch.long)  # noqa: E731
    prompt_ids = pad([torch.tensor(p) for p, _ in rows], padding_value=0, padding_side="left")
    prompt_mask = pad([ones(len(p)) for p, _ in rows], padding_value=0, padding_side="left")
    completion_ids = pad([torch.tensor(s.token_ids) for _, s in rows], padding_value=0)
    completion_mask = pad([ones(len(s.token_ids)) for _, s in rows], padding_value=0)
    sampler = pad([torch.tensor(s.logprobs) for _, s in rows], padding_value=0.0)
    with torch.no_grad():
        trainer = policy_sampler_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, params)
    return importance_weights(trainer, sampler, completion_mask, mode, None, None)
