"""Bad input fails at start-up with a message that names the field; a run stopped with SIGTERM
resumes from its checkpoint exactly where it stopped."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from mt_grpo_trainer import MTGRPOScriptArguments, MultiTurnToolEnv, build_dataset, main, render_ids
from test_smoke import RECIPE, ROOT, final_metrics, run


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(open(RECIPE).read() + text)
    return str(path)


CASES = [
    # (extra YAML, extra flags, exception, message)
    ("", ["--advantage_mode", "bogus"], ValueError, "`advantage_mode` is 'bogus'; choose one of"),
    ("", ["--weight_sync", "ftp"], ValueError, "`weight_sync` is 'ftp'"),
    ("", ["--turn_reward_weights", "1.0"], ValueError, "`turn_reward_weights` has 1 values but `turn_reward_funcs` has 2"),
    ("turn_reward_funcs: []\n", [], ValueError, "`turn_advantage_coef` is 1.0 but `turn_reward_funcs` is empty"),
    ("", ["--per_device_train_batch_size", "6"], ValueError, "generation_batch_size (6) must be divisible by num_generations (4)"),
    ("", ["--max_tokens_per_turn", "500"], ValueError, "`max_tokens_per_turn` (500) exceeds `max_completion_length` (128)"),
    ("", ["--max_tool_response_tokens", "128"], ValueError, "`max_tool_response_tokens` (128) must be below"),
    ("", ["--use_vllm", "true"], ValueError, "set `use_vllm: false` and `generation_backend: vllm_server`"),
    ("", ["--tool_timeout", "0"], ValueError, "`tool_timeout` must be a positive number of seconds"),
    ("", ["--outcome_reward_funcs", "exact_match"], ValueError, "Unknown reward function 'exact_match'. Valid names:"),
    ("", ["--outcome_reward_funcs", "reward_examples:needs_gold"], ValueError,
     "Reward function 'needs_gold' needs the dataset column 'gold'"),
    ("", ["--tools", "calculator"], ValueError, "calculator"),
    ("", ["--dataset_name", "no/such/file.jsonl"], FileNotFoundError, "no/such/file.jsonl"),
    ("", ["--max_prompt_length", "5"], ValueError, "Every prompt is longer than `max_prompt_length` (5)"),
    ("bogus_key: 3\n", [], SystemExit, "bogus_key"),
    ("", ["--use_peft", "true", "--generation_backend", "vllm_server"], ValueError, "`use_peft` with `generation_backend: vllm_server`"),
]


@pytest.mark.parametrize("yaml_extra, flags, error, message", CASES)
def test_bad_config_fails_at_start_with_the_field_named(tmp_path, tiny_agent_dir, yaml_extra, flags, error, message):
    argv = ["--config", write(tmp_path, yaml_extra), "--model_name_or_path", tiny_agent_dir,
            "--output_dir", str(tmp_path / "out"), *flags]
    with pytest.raises(error) as info:
        main(argv)
    assert message in str(info.value)


def test_missing_recipe_file_is_named():
    with pytest.raises(SystemExit, match="Recipe file not found: 'nope.yaml'"):
        main(["--config", "nope.yaml"])


def test_over_long_prompts_are_dropped_with_a_count(tiny_agent_dir, caplog):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    env = MultiTurnToolEnv(tokenizer, [], 2, 8, 16, 8, few_shot=False)
    task = type("Task", (), {"dataset": Dataset.from_dict({"question": ["short?", "long " * 400 + "?"], "answer": [["a"], ["b"]]})})
    limit = len(render_ids(tokenizer, env.prompt("short?"), add_generation_prompt=True)) + 10
    dataset = build_dataset(MTGRPOScriptArguments(max_prompt_length=limit), env, tokenizer, task)
    assert dataset["question"] == ["short?"]
    assert f"Dropped 1 of 2 prompts longer than max_prompt_length={limit}" in caplog.text


def test_sigterm_saves_a_checkpoint_and_resume_continues_exactly(tiny_agent_dir, tmp_path):
    flags = ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--max_steps", "4", "--save_strategy", "no"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # the reference: 4 steps in one go
    ref = str(tmp_path / "ref")
    run([sys.executable, "mt_grpo_trainer.py", *flags, "--output_dir", ref], tmp_path)
    # stopped with SIGTERM after step 2 has been logged
    out = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "mt_grpo_trainer.py", *flags, "--output_dir", out], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step    2 |"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    checkpoints = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    assert len(checkpoints) == 1
    stopped_at = int(checkpoints[0].split("-")[1])
    assert 2 <= stopped_at < 4
    # resumed: same steps, same learning rates, same final weights as the uninterrupted run
    run([sys.executable, "mt_grpo_trainer.py", *flags, "--output_dir", out, "--resume_from_checkpoint", "last"], tmp_path)
    resumed = {h["step"]: h for h in final_metrics(out) if "loss" in h}
    reference = {h["step"]: h for h in final_metrics(ref) if "loss" in h}
    assert sorted(resumed) == [1, 2, 3, 4][: len(resumed)] or min(resumed) == stopped_at + 1
    for step in range(stopped_at + 1, 5):
        assert resumed[step]["learning_rate"] == reference[step]["learning_rate"]
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], abs=1e-5)
    a, b = load_file(os.path.join(ref, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
