"""launch.sh --dry-run: the GPU split and the exact commands, with nothing started."""

import os
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT

RECIPE = "hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml"
ONE_CPU = ["--bf16", "false", "--use_cpu", "true", "--num_generations", "8"]  # a GPU recipe's flags parsed here
PY = sys.executable  # the launchers' PYTHON: it reads the recipe (PyYAML) and starts everything


def dry_run(*args, cwd=ROOT, **env):
    return subprocess.run(["bash", os.path.join(ROOT, "launch.sh"), "--dry-run", *args], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, "PYTHON": PY, **env}, timeout=30)


LORA_ENV, LORA_FLAGS = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ", " --enable-lora --max-lora-rank 64 --max-loras 2"
WAIT = "# wait for http://127.0.0.1:8000/health (at most 900s), then:"


def launch_server(model="Qwen/Qwen2.5-7B-Instruct", env="", flags=""):
    """The line launch.sh --dry-run prints for its vLLM server on 8 GPUs (env, flags: LORA_ENV, LORA_FLAGS)."""
    return (f"env CUDA_VISIBLE_DEVICES=7 VLLM_SERVER_DEV_MODE=1 {env}{PY} -m vllm.entrypoints.openai.api_server "
            f"--model {model} --port 8000 --tensor-parallel-size 1 --data-parallel-size 1 --gpu-memory-utilization 0.9 "
            "--max-model-len 4096 --logprobs-mode processed_logprobs --generation-config vllm "
            f"--weight-transfer-config '{{\"backend\": \"nccl\"}}'{flags} &")


def launch_train(config, flags=""):
    """The training line launch.sh --dry-run prints on 8 GPUs, for the recipe path `config` as the trainer gets it."""
    return (f"env CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6 {PY} -m accelerate.commands.launch --config_file "
            f"accelerate_configs/zero3.yaml --num_processes 7 mt_grpo_trainer.py --config {shlex.quote(config)} "
            f"--generation_backend vllm_server --vllm_server_host 127.0.0.1 --vllm_server_port 8000{flags}")


def write_recipe(folder, *changes, crlf=False):
    """RECIPE as `folder`/recipe.yaml with lines changed ((start of the old line, new text), ...), and CRLF line ends
    if asked. Returns its real path (the launchers print what `pwd -P` gives)."""
    text = open(os.path.join(ROOT, RECIPE)).read()
    for start, new in changes:
        (line,) = [line for line in text.splitlines() if line.startswith(start)]
        text = text.replace(line, new)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.yaml").write_bytes(text.replace("\n", "\r\n" if crlf else "\n").encode())
    return os.path.realpath(folder / "recipe.yaml")


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


def test_a_vision_model_is_served_with_images_beside_token_ids(tmp_path):
    """A model folder with an image processor (preprocessor_config.json), or VLLM_IMAGES=1 for a hub id: the server
    is started with --enable-scale-out, whose /inference/v1/generate takes images with token ids, and the PIL image
    processor, the trainer's (mt_grpo/engine/server_images.py); a text model's is not."""
    vlm = tmp_path / "tiny-vlm"
    vlm.mkdir()
    (vlm / "preprocessor_config.json").write_text("{}")
    images = """ --mm-processor-kwargs '{"use_fast": false}' --enable-scale-out &"""
    assert dry_run(RECIPE, "--model_name_or_path", str(vlm)).stdout.splitlines()[0].endswith(images)
    assert dry_run(RECIPE, VLLM_IMAGES="1").stdout.splitlines()[0].endswith(images)
    assert "--enable-scale-out" not in dry_run(RECIPE).stdout
    (tmp_path / "slurm").mkdir()
    slurm = slurm_dry_run(tmp_path / "slurm", "gpu[1-2]", RECIPE, "--model_name_or_path", str(vlm),
                          SLURM_GPUS_ON_NODE="2")
    servers = [line for line in slurm.stdout.splitlines() if "vllm.entrypoints" in line]
    assert slurm.returncode == 0 and len(servers) == 2 and all(s.endswith(images) for s in servers)


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


MODEL_LINE = "model_name_or_path"
QUOTED = (MODEL_LINE, 'model_name_or_path: "Qwen/Qwen2.5-7B-Instruct"   # quoted, as YAML allows')
PEFT = ("bf16", "bf16: true\nuse_peft: {}\nlora_r: 64")


@pytest.mark.parametrize("changes, crlf, env, flags", [
    ([QUOTED], False, "", ""),
    ([(MODEL_LINE, "model_name_or_path: 'Qwen/Qwen2.5-7B-Instruct'")], False, "", ""),
    ([(PEFT[0], PEFT[1].format("True"))], False, LORA_ENV, LORA_FLAGS),
    ([(PEFT[0], PEFT[1].format("yes"))], False, LORA_ENV, LORA_FLAGS),
    ([(PEFT[0], PEFT[1].format("on"))], False, LORA_ENV, LORA_FLAGS),
    ([(PEFT[0], PEFT[1].format('"y"'))], False, LORA_ENV, LORA_FLAGS),  # text the trainer's parser takes as true
    ([(PEFT[0], PEFT[1].format("False"))], False, "", ""),
    ([(PEFT[0], PEFT[1].format("off"))], False, "", ""),
    ([("bf16", "fp16: True")], False, "", " --dtype float16"),
    ([("bf16", "fp16: on")], False, "", " --dtype float16"),
    ([], True, "", ""),
    ([QUOTED, (PEFT[0], PEFT[1].format("True"))], True, LORA_ENV, LORA_FLAGS),
], ids=["double-quoted model", "single-quoted model", "use_peft True", "use_peft yes", "use_peft on",
        "use_peft quoted y", "use_peft False", "use_peft off", "fp16 True", "fp16 on", "crlf", "crlf quoted lora"])
def test_the_recipe_is_read_as_yaml_as_the_trainer_reads_it(tmp_path, changes, crlf, env, flags):
    """Quoting, YAML's booleans (True, yes, on) and CRLF line ends mean to launch.sh what they mean to the trainer:
    the exact commands, and the model and use_peft that TRL's parser reads from the same file."""
    from trl import ModelConfig, TrlParser

    from mt_grpo_trainer import MTGRPOScriptArguments

    recipe = write_recipe(tmp_path / "my recipes", *changes, crlf=crlf)  # a space in the path, as users have
    out = dry_run(recipe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [launch_server(env=env, flags=flags), WAIT, launch_train(recipe)]
    model_args = TrlParser((MTGRPOScriptArguments, ModelConfig)).parse_args_and_config(
        ["--config", recipe], return_remaining_strings=True)[1]
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct" and bool(model_args.use_peft) == bool(env)


@pytest.mark.parametrize("args, env, flags", [
    (["--use_peft", "--lora_r", "40"], LORA_ENV, LORA_FLAGS),  # a bare boolean flag is true, as in the trainer
    (["--use_peft=yes"], LORA_ENV, " --enable-lora --max-lora-rank 16 --max-loras 2"),  # TRL's default lora_r
    (["--use_peft", "true", "--use_peft", "false"], "", ""),  # the last one wins
    (["--fp16=True"], "", " --dtype float16"),
])
def test_trainer_flags_override_the_recipe_as_in_the_trainer(args, env, flags):
    out = dry_run(RECIPE, *args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [launch_server(env=env, flags=flags), WAIT,
                                       launch_train(RECIPE, " " + " ".join(args))]
    served = dry_run(RECIPE, "--model_name_or_path", "org/other").stdout.splitlines()[0]
    assert served == launch_server(model="org/other")  # the model the trainer will train is the one served


def test_launch_runs_from_another_folder(tmp_path):
    """From any folder: a relative recipe path is read from there (given to the trainer absolute), an absolute
    one inside the repository is given relative to it, and the trainer runs from the repository."""
    recipe = write_recipe(tmp_path / "my recipes")
    relative = dry_run("my recipes/recipe.yaml", cwd=tmp_path)
    assert relative.returncode == 0, relative.stderr
    assert relative.stdout.splitlines() == [launch_server(), WAIT, launch_train(recipe)]
    absolute = dry_run(os.path.join(ROOT, RECIPE), "--max_steps", "3", cwd="/tmp")
    assert absolute.returncode == 0, absolute.stderr
    assert absolute.stdout.splitlines() == [launch_server(), WAIT, launch_train(RECIPE, " --max_steps 3")]
    missing = dry_run(RECIPE, cwd=tmp_path)  # a repository-relative path is not read from elsewhere
    assert missing.returncode == 2
    assert (f"launch.sh: recipe not found: {RECIPE} (a relative path is read from {os.path.realpath(tmp_path)}; the "
            f"repository's is {os.path.realpath(ROOT)}/{RECIPE})") in missing.stderr


@pytest.mark.parametrize("line, env, message", [
    ("use_peft: maybe", {}, "recipe_values.py: use_peft: 'maybe' is not a boolean (true or false)"),
    ("lora_r: big", {}, "recipe_values.py: lora_r: 'big' is not a whole number"),
    ("model_name_or_path:", {}, "has no model_name_or_path"),
    ("", {"PYTHON": "/no/such/python"}, "PYTHON=/no/such/python not found"),
])
def test_a_recipe_the_trainer_would_refuse_stops_the_launcher(tmp_path, line, env, message):
    recipe = write_recipe(tmp_path, (MODEL_LINE, "model_name_or_path: Qwen/Qwen2.5-7B-Instruct\n" + line))
    out = dry_run(recipe, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert out.stdout == ""


def test_a_python_without_pyyaml_is_named(tmp_path):
    """PYTHON must be the trainer's interpreter: one without PyYAML (here the venv's, without site-packages) is
    named, with the setting to change."""
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {PY} -S \"$@\"\n")
    bare.chmod(0o755)
    out = dry_run(RECIPE, PYTHON=str(bare))
    assert out.returncode == 2 and out.stdout == ""
    assert "has no PyYAML: set PYTHON to the interpreter with trl installed" in out.stderr, out.stderr


# ------------------------------------------------------------------------------------------------
# scripts/slurm_launch.sh --dry-run under a fake SLURM allocation
# ------------------------------------------------------------------------------------------------
def slurm_dry_run(tmp_path, nodelist, *args, scontrol: str | None = None, cwd=ROOT,
                  script=os.path.join(ROOT, "scripts", "slurm_launch.sh"), **env):
    """The dry run with SLURM's variables set and a PATH of the few tools it needs: no scontrol (the script expands
    the node list itself), or a stub scontrol that prints `scontrol`'s lines. PYTHON is this interpreter."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "seq", "dirname"):
        if not (bin_dir / tool).exists():  # a test may run several times in one folder
            (bin_dir / tool).symlink_to(shutil.which(tool))
    if scontrol is not None:
        (bin_dir / "scontrol").write_text(f"#!{shutil.which('bash')}\nprintf '%s\\n' {scontrol}\n")
        (bin_dir / "scontrol").chmod(0o755)
    return subprocess.run(["bash", str(script), "--dry-run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=30, env={"PATH": str(bin_dir), "SLURM_JOB_NODELIST": nodelist, "PYTHON": PY, **env})


def slurm_server(node, gpu, port, model="Qwen/Qwen2.5-7B-Instruct", env="", flags=""):
    """The line slurm_launch.sh --dry-run prints for one vLLM server of one GPU (env, flags: LORA_ENV, LORA_FLAGS)."""
    return (f"srun --nodes=1 --ntasks=1 --nodelist={node} --overlap env CUDA_VISIBLE_DEVICES={gpu} "
            f"VLLM_SERVER_DEV_MODE=1 {env}{PY} -m vllm.entrypoints.openai.api_server --model {model} --host 0.0.0.0 "
            f"--port {port} --tensor-parallel-size 1 --gpu-memory-utilization 0.9 --max-model-len 4096 --logprobs-mode "
            "processed_logprobs --generation-config vllm --weight-transfer-config '{\"backend\": \"nccl\"}'"
            f"{flags} &")


def slurm_train(node, rank, machines, processes, main, urls, config=RECIPE, flags=""):
    """The line slurm_launch.sh --dry-run prints for one training node."""
    return (f"srun --nodes=1 --ntasks=1 --nodelist={node} --overlap {PY} -m accelerate.commands.launch --config_file "
            f"accelerate_configs/zero3_multinode.yaml --num_machines {machines} --num_processes {processes} "
            f"--machine_rank {rank} --main_process_ip {main} --main_process_port 29500 mt_grpo_trainer.py --config "
            f"{config} --generation_backend vllm_server --vllm_server_host 0.0.0.0 --vllm_server_port 8000 "
            f"--vllm_server_urls {' '.join(urls)} --nccl_master_address {main} --nccl_master_port 51216{flags} &")


def test_slurm_dry_run_prints_each_nodes_commands(tmp_path):
    """Three nodes of two GPUs, the last serving: two servers there (one GPU and port each), and accelerate on the
    two others with machine ranks 0 and 1, the first node as main process and NCCL rendezvous, every server's URL."""
    out = slurm_dry_run(tmp_path, "gpu[07-08],gpu10", RECIPE, "--max_steps", "3", SLURM_GPUS_ON_NODE="2")
    assert out.returncode == 0, out.stderr
    urls = ["http://gpu10:8000", "http://gpu10:8001"]
    train = [slurm_train(node, rank, 2, 4, "gpu07", urls, flags=" --max_steps 3")
             for rank, node in enumerate(["gpu07", "gpu08"])]
    assert out.stdout.splitlines() == [
        "# gpu10: vLLM server http://gpu10:8000", slurm_server("gpu10", 0, 8000),
        "# gpu10: vLLM server http://gpu10:8001", slurm_server("gpu10", 1, 8001),
        "# wait for http://gpu10:8000/health http://gpu10:8001/health (at most 900s), then:",
        "# gpu07: training, machine_rank 0", train[0],
        "# gpu08: training, machine_rank 1", train[1],
        "# wait for the training steps; on exit, failure or cancel, stop every step"]
    # the trainer takes its flags as written: every server, and no one-server field of the recipe left beside them
    from mt_grpo_trainer import parse_args

    flags = train[0].split("mt_grpo_trainer.py ", 1)[1].removesuffix(" &").split()
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


def test_slurm_reads_the_recipe_as_yaml(tmp_path):
    """As launch.sh (test_the_recipe_is_read_as_yaml_as_the_trainer_reads_it): a quoted model and `use_peft: True`
    in a CRLF recipe give the model's name and the LoRA flags to every server."""
    recipe = write_recipe(tmp_path / "my recipes", QUOTED, (PEFT[0], PEFT[1].format("True")), crlf=True)
    out = slurm_dry_run(tmp_path, "gpu[1-2]", recipe, GPUS_PER_NODE="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == ["# gpu2: vLLM server http://gpu2:8000",
                                           slurm_server("gpu2", 0, 8000, env=LORA_ENV, flags=LORA_FLAGS)]
    assert out.stdout.splitlines()[4] == slurm_train("gpu1", 0, 1, 1, "gpu1", ["http://gpu2:8000"],
                                                     config=shlex.quote(recipe))


def slurm_lines(config, flags=""):
    """Every line of the dry run on gpu[01-03,07] with one GPU a node: a server on gpu07, three training nodes."""
    urls = ["http://gpu07:8000"]
    lines = ["# gpu07: vLLM server http://gpu07:8000", slurm_server("gpu07", 0, 8000),
             "# wait for http://gpu07:8000/health (at most 900s), then:"]
    for rank, node in enumerate(["gpu01", "gpu02", "gpu03"]):
        lines += [f"# {node}: training, machine_rank {rank}",
                  slurm_train(node, rank, 3, 3, "gpu01", urls, config, flags)]
    return lines + ["# wait for the training steps; on exit, failure or cancel, stop every step"]


def test_slurm_runs_from_another_folder_and_from_sbatchs_copy(tmp_path):
    """Run in place from another folder, the repository is the script's; sbatch runs a copy from its spool folder,
    so there it is SLURM_SUBMIT_DIR or MT_GRPO_ROOT, and without either a message names MT_GRPO_ROOT. A relative
    recipe path is read from the folder the script starts in."""
    recipe = write_recipe(tmp_path / "my recipes")
    nodes = "gpu[01-03,07]"
    relative = slurm_dry_run(tmp_path, nodes, "my recipes/recipe.yaml", cwd=tmp_path, GPUS_PER_NODE="1")
    assert relative.returncode == 0, relative.stderr
    assert relative.stdout.splitlines() == slurm_lines(shlex.quote(recipe))
    absolute = slurm_dry_run(tmp_path, nodes, os.path.join(ROOT, RECIPE), "--max_steps", "3", cwd="/tmp",
                             GPUS_PER_NODE="1")
    assert absolute.returncode == 0, absolute.stderr
    assert absolute.stdout.splitlines() == slurm_lines(RECIPE, " --max_steps 3")
    spool = tmp_path / "spool"  # what sbatch runs: a copy of the script, in a folder of its own
    spool.mkdir()
    copy = spool / "slurm_script"
    copy.write_text(open(os.path.join(ROOT, "scripts", "slurm_launch.sh")).read())
    lost = slurm_dry_run(tmp_path, nodes, "my recipes/recipe.yaml", cwd=tmp_path, script=copy, GPUS_PER_NODE="1",
                         SLURM_SUBMIT_DIR=str(tmp_path))
    assert lost.returncode == 2 and lost.stdout == ""
    assert (f"slurm_launch.sh: cannot find the mt-grpo repository: sbatch runs a copy of this script, and the folder "
            f"it was submitted from (SLURM_SUBMIT_DIR={tmp_path}) is not the repository. Set MT_GRPO_ROOT to it"
            in lost.stderr)
    found = slurm_dry_run(tmp_path, nodes, "my recipes/recipe.yaml", cwd=tmp_path, script=copy, GPUS_PER_NODE="1",
                          SLURM_SUBMIT_DIR=str(tmp_path), MT_GRPO_ROOT=ROOT)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines() == slurm_lines(shlex.quote(recipe))
    submitted_here = slurm_dry_run(tmp_path, nodes, RECIPE, cwd=ROOT, script=copy, GPUS_PER_NODE="1",
                                   SLURM_SUBMIT_DIR=ROOT)  # submitted from the repository, as before
    assert submitted_here.returncode == 0, submitted_here.stderr
    assert submitted_here.stdout.splitlines() == slurm_lines(RECIPE)
    wrong = slurm_dry_run(tmp_path, nodes, RECIPE, cwd=ROOT, script=copy, MT_GRPO_ROOT=str(tmp_path))
    assert wrong.returncode == 2 and f"MT_GRPO_ROOT={tmp_path} is not the mt-grpo repository" in wrong.stderr
