"""Sharded training's collectives (issue 60): under FSDP2 and ZeRO-3 every forward gathers parameters and every
backward reduces gradients, so all ranks must make the same forwards, however many samples and tries their own
episodes give. packing.matched_forwards is the one rule; here a model sharded by FSDP2 over gloo, on 2 CPU processes
with unequal rows (tests/run_trainer.py fsdp2), makes the same forwards and collectives on both, does not hang, and
gives the gradient one unsharded process gives on the whole batch; the trainer under each shipped accelerate
config (zero2, zero3, zero3_multinode) trains 2 steps on 2 CPU processes with unequal episodes, its first gradient
one process's; and under ZeRO-3 it generates in-process (model.generate, a collective at every decoding step) while
one rank has no episode left, in training and in evaluation (DeepSpeed installed)."""

import json

import pytest
import torch

import run_trainer
from helpers import launch, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fsdp2_step(tiny_agent_dir, tmp_path_factory):
    """(per-rank counts, 2-process FSDP2 gradient, 1-process gradient) of one step of the trainer's forwards."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    run_trainer.fsdp2(tiny_agent_dir, str(tmp / "one"))  # one process: in this one, no interpreter to start
    run([*launch(2), "tests/run_trainer.py", "fsdp2", tiny_agent_dir, str(tmp / "two")], tmp, timeout=300)
    counts = [json.loads((tmp / "two" / f"rank-{r}.json").read_text()) for r in range(2)]
    return counts, torch.load(tmp / "two" / "grad.pt"), torch.load(tmp / "one" / "grad.pt")


def test_ranks_with_unequal_samples_make_the_same_forwards_and_collectives(fsdp2_step):
    """Rank 0 has 2 samples (2 sampler forwards) in 1 trie, rank 1 has 6 samples in 2 tries (a budget of 40 tokens):
    rank 0 adds 4 and 1 empty forwards, and both make every all-gather and reduce-scatter together (a count that
    differs would have hung in the run, and the timeout would fail the test)."""
    rank0, rank1 = fsdp2_step[0]
    assert rank0["matched"] == [[2, 6], [1, 2]] and rank1["matched"] == [[6, 6], [2, 2]]
    assert rank0["forwards"] == rank1["forwards"] == 8
    gathers = [r["all_gather_single"] + r.get("all_gather_into_tensor", 0) for r in (rank0, rank1)]
    reduces = [r["reduce_scatter_single"] + r.get("reduce_scatter_tensor", 0) for r in (rank0, rank1)]
    assert gathers[0] == gathers[1] > 8 and reduces[0] == reduces[1] > 0
    assert rank0["all_reduce"] == rank1["all_reduce"] == 2  # matched_forwards' own: one per forward loop


def test_the_sharded_gradient_is_the_one_process_gradient(fsdp2_step):
    """The importance-weighted loss's gradient over the global batch, gathered from FSDP2's shards, equals one
    unsharded process's on the same 4 rows (measured: 0, exactly; tolerance 1e-6 of the largest entry). The empty
    forwards add nothing."""
    _, sharded, single = fsdp2_step
    assert sharded.keys() == single.keys()
    largest = max(g.abs().max() for g in single.values())
    assert largest > 0
    for name in single:
        assert (sharded[name] - single[name]).abs().max() <= 1e-6 * largest, name


# What a CPU test rewrites in each shipped config: 2 processes on this machine, no bf16, a free port
CPU_REWRITES = {"zero2.yaml": {}, "zero3.yaml": {},
                "zero3_multinode.yaml": {"num_machines": 1, "machine_rank": 0, "main_process_ip": "127.0.0.1"}}


def episode_flags(model_dir: str, tmp_path) -> list[str]:
    """The trainer's flags for two groups on two questions (test_scoring_path's SCRIPT: QA answers at once, QB calls
    two tools first), rows split per turn, a budget of 1,000 tokens; the files they name, written into tmp_path."""
    from test_scoring_path import QA, QB, SCRIPT

    (tmp_path / "spec.json").write_text(json.dumps({"script": SCRIPT}))
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": QA, "answer": "Morvane"}) + "\n"
                                         + json.dumps({"question": QB, "answer": ["Ada Lovelace"]}) + "\n")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"title": "Morvane", "text": "Morvane was founded by Ada."}))
    return ["--config", "tests/recipes/tiny.yaml", "--model_name_or_path", model_dir,
            "--output_dir", str(tmp_path / "out"), "--dataset_name", str(tmp_path / "data.jsonl"),
            "--corpus_path", str(tmp_path / "corpus.jsonl"), "--turn_reward_funcs", "tool_execution_reward_func",
            "--outcome_reward_funcs", "exact_match_reward_func", "--max_completion_length", "512",
            "--max_tokens_per_turn", "128", "--max_tool_response_tokens", "64", "--shuffle_dataset", "false",
            "--turn_samples", "per_model_turn", "--max_tokens_per_microbatch", "1000"]


SAMPLER_FLAGS = ["--top_p", "0.9", "--top_k", "20"]  # the external sampler's truncation: the weights' sampler forwards


def deepspeed_run(name: str, mode: str, flags: list[str], tmp_path) -> list[dict]:
    """tests/run_trainer.py `mode` on 2 CPU processes under the shipped accelerate config `name`, rewritten only
    where a CPU needs it (2 processes, no bf16, a free port; the multi-node one on one machine), with DeepSpeed's
    CPU accelerator; each rank's rank-r.json. The launch's timeout fails the test: a hang."""
    pytest.importorskip("deepspeed")
    import os
    import socket
    import subprocess
    import sys

    import yaml

    from helpers import ROOT

    config = yaml.safe_load(open(os.path.join(ROOT, "accelerate_configs", name)))
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == (
        2 if name == "zero2.yaml" else 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config.update(num_processes=2, mixed_precision="no", main_process_port=port, **CPU_REWRITES[name])
    (tmp_path / name).write_text(yaml.safe_dump(config))
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / name),
             "tests/run_trainer.py", mode, str(tmp_path / "spec.json"), str(tmp_path / "dump"), *flags],
            tmp_path, timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-process run under {name} hung")
    finally:
        del os.environ["DS_ACCELERATOR"]
    return [json.loads((tmp_path / "dump" / f"rank-{r}.json").read_text()) for r in range(2)]


def assert_same_gradient(sharded: dict, single: dict) -> None:
    """The 2-process gradient equals one process's on the same batch: relative 1e-5 of the whole gradient's norm,
    which is itself well above 0 (the importance weights are near 1, so the batch teaches something)."""
    assert sharded.keys() == single.keys()
    norm = torch.sqrt(sum(g.double().square().sum() for g in single.values()))
    assert norm > 1e-2
    difference = torch.sqrt(sum((sharded[n].double() - single[n].double()).square().sum() for n in single))
    assert difference <= 1e-5 * norm, (difference / norm).item()


@pytest.fixture(scope="module")
def one_process_gradient(tiny_agent_dir, tmp_path_factory):
    """The first step's gradient of run_trainer.py `sharded` on one process, with both groups (8 rows) in its batch."""
    import sys

    tmp = tmp_path_factory.mktemp("one")
    flags = episode_flags(tiny_agent_dir, tmp) + SAMPLER_FLAGS + ["--per_device_train_batch_size", "8"]
    run([sys.executable, "tests/run_trainer.py", "sharded", str(tmp / "spec.json"), str(tmp / "dump"), *flags],
        tmp, timeout=300)
    return torch.load(tmp / "dump" / "grad.pt")


@pytest.mark.parametrize("name", sorted(CPU_REWRITES))
def test_each_shipped_deepspeed_config_trains_two_steps_with_unequal_episodes_on_two_cpu_processes(
        name, tiny_agent_dir, tmp_path, one_process_gradient):
    """Each shipped accelerate config under `accelerate launch`: the trainer with an external scripted sampler that
    reports the starting policy's own log-probs under top-p and top-k (the importance weights' sampler forwards;
    weights near 1). Rank 0's group answers at once, rank 1's calls two tools: 1 trie against 8, 4 samples against
    12; both make the maximum, train 2 steps without a hang, and the first step's gradient is one process's on
    both groups."""
    flags = episode_flags(tiny_agent_dir, tmp_path) + SAMPLER_FLAGS + ["--per_device_train_batch_size", "4"]
    rank0, rank1 = deepspeed_run(name, "sharded", flags, tmp_path)
    assert rank0["steps"] == rank1["steps"] == 2
    assert [made for _, made in rank0["matched"]] == [made for _, made in rank1["matched"]]
    assert any(own0 < own1 for (own0, _), (own1, _) in zip(rank0["matched"], rank1["matched"]))
    assert all(made == max(own0, own1) for (own0, made), (own1, _) in zip(rank0["matched"], rank1["matched"]))
    assert rank0["forwards"] == rank1["forwards"]
    # DeepSpeed keeps its own references to the gathers (not counted here); the rule's all-reduces are
    assert rank0["all_reduce"] == rank1["all_reduce"] >= len(rank0["matched"]) > 0
    assert_same_gradient(torch.load(tmp_path / "dump" / "grad.pt"), one_process_gradient)


def test_zero3_generates_in_process_when_one_rank_has_no_episode_left(tiny_agent_dir, tmp_path):
    """ZeRO-3 with `generation_backend: transformers` on 2 CPU processes (its generate all-reduces at each decoding
    step: synced_gpus): model.generate runs for real, forced to write the script (ScriptedProcessing). Rank 0's
    episodes end in round 1, rank 1's go on for two more rounds; rank 0 joins those rounds' decoding with a dummy
    row (a generate call of no prompts) and its prefill, and both train 2 steps. Then an evaluation on one question:
    rank 1's chunk is empty, and it joins rank 0's greedy episode the same way."""
    flags = episode_flags(tiny_agent_dir, tmp_path) + ["--per_device_train_batch_size", "4"]
    rank0, rank1 = deepspeed_run("zero3.yaml", "inprocess", flags, tmp_path)
    assert rank0["steps"] == rank1["steps"] == 2
    assert rank0["calls"] == [4, 0, 0, 4, 0, 0] and rank1["calls"] == [4, 4, 4, 4, 4, 4]
    assert rank0["eval_calls"] == [1] and rank1["eval_calls"] == [0]
    assert rank0["eval_episodes"] == rank1["eval_episodes"] == 1
