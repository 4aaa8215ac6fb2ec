"""launch.sh --dry-run: the GPU split and the exact commands, with nothing started."""

import os
import subprocess

import pytest

from helpers import ROOT

RECIPE = "hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml"


def dry_run(*args, **env):
    return subprocess.run(["bash", "launch.sh", "--dry-run", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=30)


@pytest.mark.parametrize("num_gpus, tp, vllm_devices, train_devices, processes", [
    ("8", "1", "7", "0,1,2,3,4,5,6", "7"),
    ("4", "1", "3", "0,1,2", "3"),
    ("8", "2", "6,7", "0,1,2,3,4,5", "6"),
])
def test_gpu_split(num_gpus, tp, vllm_devices, train_devices, processes):
    out = dry_run(RECIPE, "--max_steps", "3", NUM_GPUS=num_gpus, VLLM_TP=tp)
    assert out.returncode == 0, out.stderr
    server, wait, train = out.stdout.strip().splitlines()
    assert server.startswith(f"env CUDA_VISIBLE_DEVICES={vllm_devices} VLLM_SERVER_DEV_MODE=1 ")
    assert "--model Qwen/Qwen2.5-7B-Instruct" in server and f"--tensor-parallel-size {tp}" in server
    assert "--logprobs-mode processed_logprobs" in server and server.endswith(" &")
    assert "/health" in wait
    assert train.startswith(f"env CUDA_VISIBLE_DEVICES={train_devices} ")
    assert f"--num_processes {processes} mt_grpo_trainer.py --config {RECIPE}" in train
    assert train.endswith("--vllm_server_port 8000 --max_steps 3")


def test_default_is_eight_gpus_and_zero3():
    out = dry_run(RECIPE)
    assert "--config_file accelerate_configs/zero3.yaml --num_processes 7" in out.stdout
    assert f"# {RECIPE}: tool_format chat_template" in out.stderr  # the Qwen recipes call tools natively


@pytest.mark.parametrize("args, env, message", [
    ([RECIPE], {"NUM_GPUS": "1"}, "leaves no GPU for training"),
    (["no/such/recipe.yaml"], {}, "recipe not found"),
])
def test_bad_settings_fail_clearly(args, env, message):
    out = dry_run(*args, **env)
    assert out.returncode == 2 and message in out.stderr


def test_a_lora_recipe_gets_the_servers_lora_flags():
    """use_peft in the recipe (or among the flags): vLLM loads adapters at run time, of rank up to lora_r rounded
    up to one vLLM serves; a full-weight recipe gets none of it."""
    lora = dry_run("hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo_lora.yaml")
    assert lora.returncode == 0, lora.stderr
    server = lora.stdout.splitlines()[0]
    assert " VLLM_ALLOW_RUNTIME_LORA_UPDATING=True " in server
    assert server.endswith("--enable-lora --max-lora-rank 64 --max-loras 2 &")
    flags = dry_run(RECIPE, "--use_peft", "true", "--lora_r", "40").stdout.splitlines()[0]
    assert "--max-lora-rank 64" in flags  # 40 rounded up
    plain = dry_run(RECIPE).stdout.splitlines()[0]
    assert "lora" not in plain.lower()
    assert dry_run(RECIPE, "--use_peft", "true", "--lora_r", "1024").returncode == 2


@pytest.mark.parametrize("recipe", ["hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo_lora.yaml",
                                    "hf_recipes/Qwen/Qwen3-8B/mt_grpo_lora.yaml"])
def test_the_lora_recipes_parse_to_an_adapter_without_dropout(recipe):
    from trl import ModelConfig, TrlParser

    from mt_grpo_trainer import MTGRPOScriptArguments

    script_args, model_args, rest = TrlParser((MTGRPOScriptArguments, ModelConfig)).parse_args_and_config(
        ["--config", recipe], return_remaining_strings=True)
    assert model_args.use_peft and model_args.lora_r == 64 and model_args.lora_dropout == 0.0
    assert script_args.lora_sync == "adapter" and script_args.generation_backend == "vllm_server"
