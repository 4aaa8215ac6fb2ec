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


def test_fp16_serves_in_float16():
    """`fp16: true` (the recipe's or a flag): the server samples in float16 too; otherwise in the checkpoint's dtype."""
    server = dry_run(RECIPE, "--fp16", "true").stdout.splitlines()[0]
    assert "--dtype float16" in server and server.endswith("--dtype float16 &")
    assert "--dtype" not in dry_run(RECIPE).stdout.splitlines()[0]


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


def test_a_judge_gets_its_own_server_and_gpu():
    """JUDGE_MODEL: an LLM judge (rewards/judge.py) on its own vLLM server, on the GPU(s) just before the generation
    server's, and the trainer is told where it is; without it nothing changes."""
    out = dry_run(RECIPE, "--max_steps", "3", NUM_GPUS="8", JUDGE_MODEL="Qwen/Qwen2.5-7B-Instruct")
    assert out.returncode == 0, out.stderr
    server, judge, wait, train = out.stdout.strip().splitlines()
    assert server.startswith("env CUDA_VISIBLE_DEVICES=7 VLLM_SERVER_DEV_MODE=1 ")
    assert judge.startswith("env CUDA_VISIBLE_DEVICES=6 ") and "--model Qwen/Qwen2.5-7B-Instruct --port 8001" in judge
    assert "weight-transfer" not in judge and judge.endswith(" &")
    assert ":8000/health" in wait and ":8001/health" in wait
    assert train.startswith("env CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 ") and "--num_processes 6 " in train
    assert train.endswith("--judge_base_url http://127.0.0.1:8001/v1 --judge_model Qwen/Qwen2.5-7B-Instruct "
                          "--max_steps 3")
    two = dry_run(RECIPE, NUM_GPUS="8", JUDGE_MODEL="m", JUDGE_GPUS="2").stdout.splitlines()
    assert two[1].startswith("env CUDA_VISIBLE_DEVICES=5,6 ") and "--tensor-parallel-size 2" in two[1]
    crowded = dry_run(RECIPE, NUM_GPUS="2", JUDGE_MODEL="m")
    assert crowded.returncode == 2 and "1 for the judge (JUDGE_GPUS)" in crowded.stderr
