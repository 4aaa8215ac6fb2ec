"""DAPO's dynamic sampling (`dynamic_sampling`): groups whose advantages would all be 0 are replaced by new
questions' groups before the step. MTGRPOEnvTrainer's `_generate_and_score_completions` calls `resample_groups`
with its rollout and scoring stages; what counts as signal is the trainer's `groups_with_signal`."""

from typing import Callable

import torch


def resample_questions(num_rows: int, count: int, seed: int, step: int, round_: int) -> list[int]:
    """Dataset rows of `count` new questions for dynamic sampling: drawn uniformly from a generator seeded by
    (seed, step, round), so every process draws the same ones without talking (a group may span processes)
    and a resumed run draws what the uninterrupted run would have."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + round_)
    return torch.randint(num_rows, (count,), generator=generator).tolist()


def resample_groups(trainer, inputs: list[dict], episodes: list, scores, seconds: float, *, roll_out: Callable,
                    score: Callable, has_signal: Callable) -> tuple[list[dict], list, object, float]:
    """DAPO's dynamic sampling: each group whose advantages would all be 0 is rolled out again on a new
    question (the same one on every process that holds part of the group), and the batch is scored again,
    until every group has signal or `dynamic_sampling_max_rounds` rounds ran. The batch keeps its size, so
    the step's cost grows by the rounds' rollouts and nothing else changes downstream. `roll_out`, `score` and
    `has_signal` (the groups a step learns from): the trainer's stages."""
    args, G = trainer.args, trainer.num_generations
    B, rank = len(episodes), trainer.accelerator.process_index
    passes, rolled = [], list(range(len(scores.R_O) // G))  # per pass: its scores, signal, groups rolled out
    for round_ in range(args.dynamic_sampling_max_rounds + 1):  # the last pass only judges the final batch
        signal = has_signal(scores)  # (groups,) bool
        passes.append((scores, signal, rolled))
        empty = (~signal).nonzero().flatten().tolist()  # global group indices: the same on every process
        if not empty or round_ == args.dynamic_sampling_max_rounds:
            break
        new_rows = dict(zip(empty, resample_questions(len(trainer.train_dataset), len(empty), args.seed,
                                                      trainer.state.global_step, round_)))
        mine = [i for i in range(B) if (rank * B + i) // G in new_rows]
        new_inputs = [dict(trainer.train_dataset[new_rows[(rank * B + i) // G]]) for i in mine]
        # every process rolls out, even with no rows: lock-step generation rounds are collective
        _, new_episodes, more = roll_out(new_inputs, "train")
        trainer.env.release([episodes[i] for i in mine])  # the replaced episodes' environment instances, if any
        for i, x, ep in zip(mine, new_inputs, new_episodes):
            inputs[i], episodes[i] = x, ep
        seconds += more
        scores, rolled = score([x["prompt"] for x in inputs], episodes, inputs), empty
    trainer.log_dynamic_sampling(passes)  # the first draw and the replacements, apart (reporting.py)
    return inputs, episodes, scores, seconds
