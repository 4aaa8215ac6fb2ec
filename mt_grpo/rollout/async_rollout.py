"""Overlapped generation (`async_rollout`): the seeded prompt stream and the background rollout of the
next generation batch. Given callables, not the trainer: mt_grpo_trainer.MTGRPOEnvTrainer wires them."""

import functools
import threading
import time
from typing import Callable

import torch


class PromptStream:
    """Generation batches of prompts in a seeded order, each prompt repeated num_generations times and
    the batch split over the processes in order, as TRL's sampler lays them out. Batch b depends on b
    alone, so a resumed run continues with the same prompts. (async_rollout takes its prompts from here:
    it must know batch b + 1 while the trainer still trains on batch b.)"""

    def __init__(self, dataset, num_generations: int, args, accelerator):
        self.dataset = dataset
        self.num_generations = num_generations
        self.prompts_per_batch = args.generation_batch_size // num_generations
        self.seed = args.seed
        self.shuffle = args.shuffle_dataset
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes

    @functools.lru_cache(maxsize=2)
    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        return torch.randperm(len(self.dataset),
                              generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def batch(self, b: int) -> list[dict]:
        """This process's rows of generation batch b."""
        n = len(self.dataset)
        positions = range(b * self.prompts_per_batch, (b + 1) * self.prompts_per_batch)
        rows = [self.dataset[self.order(k // n)[k % n]] for k in positions
                for _ in range(self.num_generations)]
        local = len(rows) // self.world
        return rows[self.rank * local : (self.rank + 1) * local]


class AsyncRollouts:
    """Overlapped generation (async_rollout, max_staleness 1): while the trainer runs optimizer steps on
    generation batch b, a background thread has the server sample batch b + 1 with the weights synced
    before it started. Weights are synced only here, between batches, when no request is in flight; the
    thread makes HTTP requests only (no collective), so ranks never wait on each other inside it. A
    pending rollout is not saved in a checkpoint: a resumed run samples its first batch again.
    Given callables, not the trainer: `roll_out(prompts, rows)` -> episodes, `sync()` gives the sampler the
    current policy, `version()` is the policy's optimizer step."""

    def __init__(self, stream: PromptStream, roll_out: Callable[[list, list], list], sync: Callable[[], None],
                 version: Callable[[], int]):
        self.stream = stream
        self.roll_out = roll_out
        self.sync = sync
        self.version = version
        self.pending: tuple[int, threading.Thread, dict] | None = None  # (batch index, thread, result)

    def start(self, b: int) -> tuple[int, threading.Thread, dict]:
        result, inputs, version = {}, self.stream.batch(b), self.version()

        def roll_out():
            t0 = time.perf_counter()
            try:
                episodes = self.roll_out([x["prompt"] for x in inputs], inputs)  # the rows: their images, if any
                for ep in episodes:
                    ep.policy_version = version
                result["value"] = (inputs, episodes, time.perf_counter() - t0)
            except BaseException as e:  # re-raised on the trainer's thread
                result["error"] = e

        # a daemon thread: a rollout still running when training ends must not keep the process alive
        thread = threading.Thread(target=roll_out, daemon=True, name="async-rollout")
        thread.start()
        return b, thread, result

    def wait(self) -> None:
        if self.pending is not None:
            self.pending[1].join()

    def next(self, b: int) -> tuple[list[dict], list, float]:
        """Generation batch b (rolled out in the background while b - 1 trained), and start b + 1."""
        if self.pending is None or self.pending[0] != b:  # the first batch, or the first after a resume
            self.wait()
            self.sync()
            self.pending = self.start(b)
        self.wait()
        _, _, result = self.pending
        if "error" in result:
            self.pending = None
            raise result["error"]
        self.sync()  # nothing is in flight now
        self.pending = self.start(b + 1)
        return result["value"]


def generation_index(micro_step: int, generate_every: int, first: int) -> int:
    """Index of the generation batch TRL asks for at `micro_step` (micro-steps since this run started:
    TRL generates when micro_step % generate_every == 0, generate_every = steps_per_generation x
    num_iterations), counting from `first`, the first batch of this run."""
    return first + micro_step // generate_every


def first_generation(global_step: int, gradient_accumulation_steps: int, generate_every: int) -> int:
    """The first generation batch of a run that starts (or resumes) at `global_step`: the next one not yet
    begun. A batch a checkpoint cut in the middle is not trained again (TRL generates afresh on resume)."""
    return -(-global_step * gradient_accumulation_steps // generate_every)
