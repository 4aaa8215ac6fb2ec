"""Sharded training's collectives (issue 60): under FSDP2 and ZeRO-3 every forward gathers parameters and every
backward reduces gradients, so all ranks must make the same forwards, however many samples and tries their own
episodes give. packing.matched_forwards is the one rule; here a model sharded by FSDP2 over gloo, on 2 CPU processes
with unequal rows (tests/run_trainer.py fsdp2), makes the same forwards and collectives on both, does not hang, and
gives the gradient one unsharded process gives on the whole batch."""

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
