"""Shared-prefix generation (packing.prefilled_inputs) against plain left-padded `model.generate`, in the in-process
backend, on the study's real rollouts: SmolLM2-135M-Instruct, hf_recipes/SmolLM2-135M-Instruct/study.yaml (the
fictional KB's few-shot prompts, the search tool, two tool turns).

    .venv/bin/python studies/prefix_generate.py

Two workloads, each rolled out with the prefix shared and not, alternately, `--repeats` times, greedy so that both
do the same work (and so the episodes must be token for token the same, which is checked): a training group (one
question x num_generations) and an evaluation batch (per_device_eval_batch_size questions, one episode each). The
ratio is shared / plain wall time of the whole rollout (generation and tool calls), the median over repeats.
"""

import argparse
import statistics
import tempfile
import time

import torch
from common import ROOT, print_table  # noqa: F401 (sys.path)

import mt_grpo_trainer as mt
from mt_grpo.engine import sampling
from mt_grpo.engine import packing
from mt_grpo.engine.sampling import GREEDY

RECIPE = f"{ROOT}/hf_recipes/SmolLM2-135M-Instruct/study.yaml"


def rollout(trainer, rows: list[dict], share: bool) -> tuple[float, list[list[int]]]:
    """Seconds for the env's rollout of `rows`, greedy, and each episode's tokens."""
    sampling.prefilled_inputs = lambda *a, **k: packing.prefilled_inputs(*a, **{**k, "share": share})
    t0 = time.perf_counter()
    episodes = trainer.env.rollout([x["prompt"] for x in rows], trainer.backend, GREEDY, rows=rows)
    seconds = time.perf_counter() - t0
    sampling.prefilled_inputs = packing.prefilled_inputs
    return seconds, [ep.prompt_ids + ep.completion_ids for ep in episodes]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = mt.build_trainer(["--config", RECIPE, "--dataset_name", "fictional_kb_entities", "--max_steps", "1",
                                "--output_dir", tempfile.mkdtemp(), "--eval_strategy", "no"])
    trainer.backend.sync_weights(trainer.model, trainer.accelerator)
    trainer.model.eval()
    data, args_ = trainer.train_dataset, trainer.args
    workloads = {
        f"training group: 1 question x {args_.num_generations}": [dict(data[0])] * args_.num_generations,
        f"evaluation: {args_.per_device_eval_batch_size} questions x 1": [dict(data[i]) for i in
                                                                         range(args_.per_device_eval_batch_size)],
    }
    table = []
    for name, rows in workloads.items():
        times, same = {True: [], False: []}, True
        for r in range(args.repeats):
            runs = {share: rollout(trainer, rows, share) for share in ((True, False) if r % 2 == 0 else (False, True))}
            same &= runs[True][1] == runs[False][1]
            for share, (seconds, _) in runs.items():
                times[share].append(seconds)
        shared, plain = statistics.median(times[True]), statistics.median(times[False])
        tokens = sum(len(ids) for ids in runs[True][1])
        table.append([name, tokens, round(plain, 1), round(shared, 1), round(shared / plain, 2),
                      "identical" if same else "DIFFER"])
    print_table(f"Rollout wall time, median of {args.repeats} (torch threads: {torch.get_num_threads()})",
                ["workload", "episode tokens", "plain s", "shared prefix s", "shared / plain", "episodes"], table)


if __name__ == "__main__":
    main()
