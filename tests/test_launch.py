"""launch.sh --dry-run: the GPU split and the exact commands, with nothing started."""

import os
import subprocess

import pytest

from helpers import ROOT

RECIPE = "hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml"
ONE_CPU = ["--bf16", "false", "--use_cpu", "true", "--num_generations", "8"]  # a GPU recipe's flags parsed here


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


def test_several_servers_on_one_node_each_get_their_gpus_and_port_and_the_trainer_gets_every_url():
    """VLLM_SERVERS: that many servers on the last GPUs, each VLLM_TP GPUs and its own port, and the trainer's
    vllm_server_urls lists them all (server_pool.py), parsed as the trainer parses its flags; a judge whose port is
    a server's is refused with the port to use."""
    from mt_grpo_trainer import parse_args

    out = dry_run(RECIPE, "--max_steps", "3", NUM_GPUS="8", VLLM_SERVERS="3", VLLM_TP="2")
    assert out.returncode == 0, out.stderr
    *servers, wait, train = out.stdout.strip().splitlines()
    assert [line.split()[1] for line in servers] == ["CUDA_VISIBLE_DEVICES=2,3", "CUDA_VISIBLE_DEVICES=4,5",
                                                     "CUDA_VISIBLE_DEVICES=6,7"]
    assert [line.split("--port ")[1].split()[0] for line in servers] == ["8000", "8001", "8002"]
    assert wait.startswith("# wait for http://127.0.0.1:8000/health and :8001/health and :8002/health")
    assert train.startswith("env CUDA_VISIBLE_DEVICES=0,1 ") and "--num_processes 2 " in train
    trainer_flags = train.split("mt_grpo_trainer.py ", 1)[1].split()
    script_args = parse_args([*trainer_flags, *ONE_CPU])[0]
    assert script_args.vllm_server_urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    clash = dry_run(RECIPE, VLLM_SERVERS="2", JUDGE_MODEL="m")
    assert clash.returncode == 2 and "JUDGE_PORT=8001 is one of the vLLM servers' ports" in clash.stderr
    assert "set JUDGE_PORT=8002" in clash.stderr
    assert dry_run(RECIPE, VLLM_SERVERS="0").returncode == 2


# ------------------------------------------------------------------------------------------------
# scripts/slurm_launch.sh --dry-run under a fake SLURM allocation
# ------------------------------------------------------------------------------------------------
def slurm_dry_run(tmp_path, nodelist, *args, scontrol: str | None = None, **env):
    """The dry run with SLURM's variables set and a PATH of the few tools it needs: no scontrol (the script expands
    the node list itself), or a stub scontrol that prints `scontrol`'s lines."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "seq", "awk", "sed", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if scontrol is not None:
        (bin_dir / "scontrol").write_text(f"#!{shutil.which('bash')}\nprintf '%s\\n' {scontrol}\n")
        (bin_dir / "scontrol").chmod(0o755)
    return subprocess.run(["bash", "scripts/slurm_launch.sh", "--dry-run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, env={"PATH": str(bin_dir), "SLURM_JOB_NODELIST": nodelist, **env})


def test_slurm_dry_run_prints_each_nodes_commands(tmp_path):
    """Three nodes of two GPUs, the last serving: two servers there (one GPU and port each), and accelerate on the
    two others with machine ranks 0 and 1, the first node as main process and NCCL rendezvous, every server's URL."""
    out = slurm_dry_run(tmp_path, "gpu[07-08],gpu10", RECIPE, "--max_steps", "3", SLURM_GPUS_ON_NODE="2")
    assert out.returncode == 0, out.stderr
    server = ("srun --nodes=1 --ntasks=1 --nodelist=gpu10 --overlap env CUDA_VISIBLE_DEVICES={gpu} VLLM_SERVER_DEV_MODE=1 "
              "python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B-Instruct --host 0.0.0.0 --port {port} "
              "--tensor-parallel-size 1 --gpu-memory-utilization 0.9 --max-model-len 4096 --logprobs-mode "
              "processed_logprobs --generation-config vllm --weight-transfer-config '{{\"backend\": \"nccl\"}}' &")
    train = ("srun --nodes=1 --ntasks=1 --nodelist={node} --overlap python -m accelerate.commands.launch --config_file "
             "accelerate_configs/zero3_multinode.yaml --num_machines 2 --num_processes 4 --machine_rank {rank} "
             f"--main_process_ip gpu07 --main_process_port 29500 mt_grpo_trainer.py --config {RECIPE} "
             "--generation_backend vllm_server --vllm_server_host 0.0.0.0 --vllm_server_port 8000 "
             "--vllm_server_urls http://gpu10:8000 http://gpu10:8001 "
             "--nccl_master_address gpu07 --nccl_master_port 51216 --max_steps 3 &")
    assert out.stdout.splitlines() == [
        "# gpu10: vLLM server http://gpu10:8000", server.format(gpu=0, port=8000),
        "# gpu10: vLLM server http://gpu10:8001", server.format(gpu=1, port=8001),
        "# wait for http://gpu10:8000/health http://gpu10:8001/health (at most 900s), then:",
        "# gpu07: training, machine_rank 0", train.format(node="gpu07", rank=0),
        "# gpu08: training, machine_rank 1", train.format(node="gpu08", rank=1),
        "# wait for the training steps; on exit, failure or cancel, stop every step"]
    # the trainer takes its flags as written: every server, and no one-server field of the recipe left beside them
    from mt_grpo_trainer import parse_args

    flags = train.format(node="gpu07", rank=0).split("mt_grpo_trainer.py ", 1)[1].removesuffix(" &").split()
    parsed = parse_args([*flags, *ONE_CPU])[0]
    assert parsed.vllm_server_urls == ["http://gpu10:8000", "http://gpu10:8001"]


def test_slurm_serves_an_fp16_recipe_in_float16(tmp_path):
    """As launch.sh (test_fp16_serves_in_float16): `fp16: true` puts every server in float16, and only then."""
    (tmp_path / "fp16").mkdir(), (tmp_path / "plain").mkdir()  # slurm_dry_run's tool folder, one per run
    fp16 = slurm_dry_run(tmp_path / "fp16", "gpu[1-2]", RECIPE, "--fp16", "true", SLURM_GPUS_ON_NODE="2")
    plain = slurm_dry_run(tmp_path / "plain", "gpu[1-2]", RECIPE, SLURM_GPUS_ON_NODE="2")
    assert fp16.returncode == 0 and plain.returncode == 0, fp16.stderr + plain.stderr
    servers = [line for line in fp16.stdout.splitlines() if "vllm.entrypoints" in line]
    assert len(servers) == 2 and all(s.endswith("--dtype float16 &") for s in servers)
    assert "--dtype" not in plain.stdout


def test_slurm_dry_run_with_tensor_parallel_servers_lora_and_scontrol(tmp_path):
    """VLLM_TP=2 on nodes of four GPUs: two servers a node on GPUs 0,1 and 2,3; two vLLM nodes; a LoRA recipe's
    servers load adapters; the node list from a stub scontrol, not from SLURM_JOB_NODELIST."""
    out = slurm_dry_run(tmp_path, "ignored[1-9]", "hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo_lora.yaml",
                        scontrol="a1 b2 c3", GPUS_PER_NODE="4", VLLM_TP="2", VLLM_NODES="2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    servers = [line for line in lines if "vllm.entrypoints" in line]
    assert [(s.split("--nodelist=")[1].split()[0], s.split("CUDA_VISIBLE_DEVICES=")[1].split()[0],
             s.split("--port ")[1].split()[0]) for s in servers] == [
        ("b2", "0,1", "8000"), ("b2", "2,3", "8001"), ("c3", "0,1", "8000"), ("c3", "2,3", "8001")]
    assert all("--tensor-parallel-size 2 " in s and s.endswith("--enable-lora --max-lora-rank 64 --max-loras 2 &")
               for s in servers)
    (train,) = [line for line in lines if "accelerate.commands.launch" in line]
    assert "--nodelist=a1 " in train and "--num_machines 1 --num_processes 4 --machine_rank 0 " in train
    assert "--vllm_server_urls http://b2:8000 http://b2:8001 http://c3:8000 http://c3:8001 " in train


@pytest.mark.parametrize("nodelist, env, message", [
    ("gpu1", {}, "1 node(s) (gpu1) and VLLM_NODES=1: at least one node must serve and one train"),
    ("gpu[1-2]", {"VLLM_NODES": "2"}, "at least one node must serve and one train"),
    ("gpu[1-2]", {"GPUS_PER_NODE": "8", "VLLM_TP": "3"}, "VLLM_TP=3 does not divide GPUS_PER_NODE=8"),
    ("rack[1-2]-n[1-2]", {}, "cannot expand 'rack[1-2]-n[1-2]' without scontrol"),
    ("", {}, "SLURM_JOB_NODELIST is not set"),
])
def test_slurm_bad_settings_fail_clearly(tmp_path, nodelist, env, message):
    out = slurm_dry_run(tmp_path, nodelist, RECIPE, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
