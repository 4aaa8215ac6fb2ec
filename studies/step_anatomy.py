"""One training step of the study recipe, phase by phase, beside the raw PyTorch limits for the same
tokens, in one run:

    .venv/bin/python studies/step_anatomy.py                       # hf_recipes/SmolLM2-135M-Instruct/study.yaml
    .venv/bin/python studies/step_anatomy.py --steps 3 -- --activation_checkpointing false   # recipe flags after --

The trainer runs `--steps` real optimizer steps (evaluation off) with its stages timed where they are
called: the rollout (its generate calls and its tool calls apart), the old / reference logprobs, the
scoring and logging (an LLM judge's requests apart, when a reward is one: rewards/judge.py), the forward, the
backward and the optimizer. Each phase's peak memory is sampled
every 5 ms (RSS on CPU; torch.cuda.max_memory_allocated / reserved on GPU). Then, in the same process
and on the last step's tokens, the limits:
  - raw `model.generate`: each of the rollout's generate calls again, with the same prompts, number of
    samples and new tokens (min_new_tokens = max_new_tokens), nothing but sampling at the temperature;
  - a raw forward + backward + AdamW step on the same padded batch (the completion positions' full-vocabulary
    logits, log_softmax, masked mean).
It prints per phase its seconds per step, its peak memory and its ratio to the limit, the padding
share of the batch (padded tokens / real tokens), and the whole run's peak RSS. Steps after the first
are averaged (the first pays for warm-up)."""

import argparse
import functools
import os
import resource
import sys
import tempfile
import threading
import time
from collections import defaultdict

import torch
from common import ROOT, print_table, rss

import mt_grpo_trainer as mt
from mt_grpo.rewards.judge import judges_of
from transformers import TrainerCallback

RECIPE = os.path.join(ROOT, "hf_recipes", "SmolLM2-135M-Instruct", "study.yaml")
GiB = 1024**3


class Phases:
    """Wall time and peak memory per named phase (a phase inside another counts in both)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.peak = defaultdict(float)  # bytes
        self.current: list[str] = []
        self.cuda = torch.cuda.is_available()
        self.stop = False
        threading.Thread(target=self._sample, daemon=True).start()

    rss = staticmethod(rss)

    def _sample(self):
        while not self.stop:
            if self.current and not self.cuda:
                rss = self.rss()
                for name in list(self.current):
                    self.peak[name] = max(self.peak[name], rss)
            time.sleep(0.005)

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.current.append(name)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                if self.cuda:
                    self.peak[name] = max(self.peak[name], torch.cuda.max_memory_allocated())
                    self.peak[name + " (reserved)"] = max(self.peak[name + " (reserved)"],
                                                          torch.cuda.max_memory_reserved())
                self.current.pop()
        return timed


class StepTimes(TrainerCallback):
    """Per optimizer step: the seconds of each phase (a snapshot of the running totals), and the optimizer."""

    def __init__(self, phases: Phases):
        self.phases, self.steps, self.t0, self.opt0 = phases, [], 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0, self.before = time.perf_counter(), dict(self.phases.seconds)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.opt0 = time.perf_counter()
        self.phases.current.append("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.phases.current.pop()
        self.phases.seconds["optimizer"] += time.perf_counter() - self.opt0

    def on_step_end(self, args, state, control, **kwargs):
        step = {k: v - self.before.get(k, 0.0) for k, v in self.phases.seconds.items()}
        step["step"] = time.perf_counter() - self.t0
        self.steps.append(step)


def instrument(trainer, phases: Phases) -> dict:
    """Time the trainer's stages where they are called; keep the generate calls and the last batch."""
    seen = {"generate_calls": [], "batch": None}
    backend, env = trainer.backend, trainer.env
    generate = backend.generate

    def recording_generate(prompts, max_tokens, n=1, params=None):
        samples = generate(prompts, max_tokens, n, params)
        seen["generate_calls"].append((prompts, n, max((len(s.token_ids) for s in samples), default=0)))
        return samples

    backend.generate = phases.wrap("rollout: generate", recording_generate)
    mt.run_turns = phases.wrap("rollout: tools", mt.run_turns)
    env.rollout = phases.wrap("rollout", env.rollout)
    trainer._tensors = phases.wrap("old / ref logprobs", trainer._tensors)
    for name in ("_score", "_advantages", "_correct_for_sampler", "_log", "_record_rollout"):
        setattr(trainer, name, phases.wrap("scoring + logging", getattr(trainer, name)))
    for judge in judges_of(trainer.turn_reward_funcs + trainer.outcome_reward_funcs):  # its requests, in scoring
        judge.complete = phases.wrap("scoring: judge", judge.complete)
    trainer.compute_loss = phases.wrap("forward", trainer.compute_loss)
    trainer.accelerator.backward = phases.wrap("backward", trainer.accelerator.backward)
    score = trainer._generate_and_score_completions

    def keep_batch(inputs):
        seen["batch"] = score(inputs)
        return seen["batch"]

    trainer._generate_and_score_completions = keep_batch
    return seen


def raw_generate(model, tokenizer, calls, temperature: float, phases: Phases) -> None:
    """Each recorded generate call again: same prompts (left-padded), samples and new tokens."""
    from trl.trainer.utils import pad

    device = next(model.parameters()).device
    model.eval()  # as the trainer generates: no dropout, and a KV cache despite activation checkpointing
    for prompts, n, new_tokens in calls:
        if not new_tokens:
            continue
        rows = [p for p in prompts for _ in range(n)]
        ids = pad([torch.tensor(r) for r in rows], padding_value=tokenizer.pad_token_id, padding_side="left")
        mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], padding_value=0, padding_side="left")
        with torch.no_grad():
            phases.wrap("limit: generate", model.generate)(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=temperature,
                top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=tokenizer.pad_token_id)


def raw_train_step(model, batch, phases: Phases) -> None:
    """Forward + backward + AdamW on the batch's padded tokens, in plain PyTorch."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = (batch["completion_mask"] * batch["tool_mask"]).float()
    T = batch["completion_ids"].shape[1]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    model.train()

    def forward_backward():
        # logits of the completion positions only (logits_to_keep), as a plain PyTorch user would ask
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=T + 1).logits[:, :-1].float()
        logps = logits.log_softmax(-1).gather(2, batch["completion_ids"][:, :, None]).squeeze(2)
        loss = -(logps * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()

    phases.wrap("limit: forward + backward", forward_backward)()
    phases.wrap("limit: optimizer", optimizer.step)()
    optimizer.zero_grad(set_to_none=True)


def arm_batch(trainer, batch: dict, packed: bool) -> dict:
    """Set the trainer to forward `batch` packed or padded, whatever the recipe says: `padding_free`, and, for the
    padded arm, rows split into per-turn samples (turn_samples), which the trainer forwards packed whatever
    `padding_free` says, forwarded whole (each sample then sees the ones before it: the cost of the padded layout,
    not its loss)."""
    trainer.args.padding_free = packed
    if packed or batch.get("sample_starts") is None:
        return batch
    return {**batch, "sample_starts": torch.zeros_like(batch["sample_starts"])}  # no row split


def train_on(trainer, batch, padding_free: bool, rows: int, optimizer, phases: Phases, name: str) -> float:
    """The non-rollout work of a step on `batch`, as the trainer does it: the old / reference logprobs (when the
    recipe needs them), the loss's forward and backward per micro-batch of `rows` rows, AdamW. Returns the loss."""
    batch = arm_batch(trainer, batch, padding_free)
    B = len(batch["completion_ids"])
    micro = [list(range(i, min(i + rows, B))) for i in range(0, B, rows)]
    trainer.current_gradient_accumulation_steps = len(micro)
    trainer.model.train()

    def step():
        b = dict(batch)
        trainer._add_old_and_ref_logps(b)
        total = 0.0
        for r in micro:
            loss = trainer.compute_loss(trainer.model, {k: v[r] if isinstance(v, torch.Tensor) and v.ndim else v
                                                        for k, v in b.items()})
            trainer.accelerator.backward(loss)
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return phases.wrap(name, step)()


def compare_packing(trainer, batch, phases: Phases, scoring: float, budget: int | None) -> None:
    """Padded against packed on the last step's batch, side by side: the recipe's padded micro-batches (and the
    whole batch padded at once), then the whole batch packed (padding_free, its token budget)."""
    from mt_grpo.engine.packing import plan_rows

    B, T = batch["completion_ids"].shape
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    tries = plan_rows(ids.cpu(), attention.cpu(), T, budget)[0]
    real, unique = int(attention.sum()), sum(len(t.tokens) for t in tries)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-7)
    rows = trainer.args.per_device_train_batch_size
    arms = [("packed", True, B), (f"padded, {rows} row(s) per micro-batch", False, rows)]
    if rows != B:
        arms.append((f"padded, {B} rows at once", False, B))
    seconds, peaks, losses = {}, {}, {}
    for repeat in range(2):  # the first pays for warm-up; keep the second's time, the first's memory
        for name, padding_free, r in arms:
            phases.seconds.pop(name, None)
            start = phases.rss()
            losses[name] = train_on(trainer, batch, padding_free, r, optimizer, phases, name)
            seconds[name] = phases.seconds[name] + scoring
            if repeat == 0:
                peaks[name] = (phases.peak[name] - start) / GiB if not phases.cuda else phases.peak[name] / GiB
    if batch.get("sample_starts") is not None and batch["sample_starts"].any():
        print("rows split into per-turn samples: the padded arms forward them whole (their loss differs)")
    padded_name = min((a[0] for a in arms[1:]), key=seconds.get)
    rows_ = [[name, seconds[name], f"{peaks[name]:.2f}", f"{losses[name]:.6f}", seconds[name] / seconds[padded_name]]
             for name, _, _ in arms]
    what = "GPU GiB allocated" if phases.cuda else "GiB of RSS above its start"
    print_table(f"Non-rollout part of a step on the last batch (logprobs, forward + backward, AdamW, and the run's "
                f"scoring + logging, {scoring:.2f} s), padded against packed", ["layout", "s", f"peak ({what})",
                "loss", f"/ {padded_name}"], rows_)
    print(f"packing: {B} rows x {ids.shape[1]} padded tokens = {ids.numel()}; {real} real, {unique} forwarded in "
          f"{len(tries)} tries (budget {budget}): packing ratio {real / unique:.2f} (raw / unique tokens), "
          f"{ids.numel() / unique:.2f} padded / unique")
    print(f"packed/padded non-rollout: {seconds['packed'] / seconds[padded_name]:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is left out of the means")
    ap.add_argument("--no-compare-packing", dest="compare_packing", action="store_false",
                    help="skip the padded-against-packed comparison on the last batch")
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    phases = Phases()
    trainer = mt.build_trainer(["--config", args.recipe, "--max_steps", str(args.steps), "--eval_strategy", "no",
                                "--output_dir", tempfile.mkdtemp(), "--save_strategy", "no", "--disable_tqdm",
                                "true", *flags])
    times = StepTimes(phases)
    trainer.add_callback(times)
    seen = instrument(trainer, phases)
    calls_per_step = []
    trainer.add_callback(type("CountCalls", (TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: calls_per_step.append(len(seen["generate_calls"]))})())
    trainer.train()

    steps = times.steps[1:] or times.steps
    mean = lambda key: sum(s.get(key, 0.0) for s in steps) / len(steps)  # noqa: E731
    batch = seen["batch"]
    last_calls = seen["generate_calls"][calls_per_step[-2] if len(calls_per_step) > 1 else 0:]
    model = trainer.accelerator.unwrap_model(trainer.model)
    for _ in range(2):  # the first of each limit pays for warm-up; keep the second
        phases.seconds.pop("limit: generate", None)
        raw_generate(model, trainer.processing_class, last_calls, trainer.args.temperature, phases)
    for _ in range(2):
        for k in ("limit: forward + backward", "limit: optimizer"):
            phases.seconds.pop(k, None)
        raw_train_step(model, batch, phases)

    rollout, generate, tools = mean("rollout"), mean("rollout: generate"), mean("rollout: tools")
    fwd_bwd, opt = mean("forward") + mean("backward"), mean("optimizer")
    lim = phases.seconds
    lim_gen, lim_fb, lim_opt = lim["limit: generate"], lim["limit: forward + backward"], lim["limit: optimizer"]
    non_rollout = mean("step") - rollout
    real = (batch["prompt_mask"].sum() + batch["completion_mask"].sum()).item()
    padded = batch["prompt_ids"].numel() + batch["completion_ids"].numel()
    mem = lambda name: f"{phases.peak[name] / GiB:.2f}" if name in phases.peak else "-"  # noqa: E731
    rows = [
        ["rollout", rollout, mem("rollout"), "raw generate + tools", lim_gen + tools, rollout / (lim_gen + tools)],
        ["  generate", generate, mem("rollout: generate"), "raw generate", lim_gen, generate / lim_gen],
        ["  tools", tools, mem("rollout: tools"), "", "", ""],
        ["old / ref logprobs", mean("old / ref logprobs"), mem("old / ref logprobs"), "", "", ""],
        ["scoring + logging", mean("scoring + logging"), mem("scoring + logging"), "", "", ""],
        *([["  judge", mean("scoring: judge"), mem("scoring: judge"), "", "", ""]]
          if "scoring: judge" in phases.seconds else []),
        ["forward + backward", fwd_bwd, f"{mem('forward')} / {mem('backward')}", "raw forward + backward",
         lim_fb, fwd_bwd / lim_fb],
        ["optimizer", opt, mem("optimizer"), "raw AdamW", lim_opt, opt / lim_opt],
        ["step (non-rollout part)", non_rollout, "", "raw fwd + bwd + AdamW", lim_fb + lim_opt,
         non_rollout / (lim_fb + lim_opt)],
        ["step", mean("step"), "", "", "", ""],
    ]
    unit = "GPU GiB (allocated)" if torch.cuda.is_available() else "RSS GiB"
    print_table(f"One step of {os.path.relpath(args.recipe, ROOT)} {' '.join(flags)}: mean of steps 2-{args.steps} "
                f"(seconds; peak memory in {unit})",
                ["phase", "s/step", "peak", "limit", "limit s", "ratio"], rows)
    print(f"\nbatch: {batch['completion_ids'].shape[0]} rows x {padded // batch['completion_ids'].shape[0]} tokens, "
          f"{real} real: padding share {padded / real:.2f} (padded / real tokens); "
          f"model tokens {int((batch['completion_mask'] * batch['tool_mask']).sum())}")
    print(f"whole run: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f} GiB"
          + (f", peak GPU memory {torch.cuda.max_memory_reserved() / GiB:.2f} GiB reserved"
             if torch.cuda.is_available() else ""))
    if args.compare_packing:
        compare_packing(trainer, batch, phases, mean("scoring + logging"),
                        trainer.args.max_tokens_per_microbatch)
    phases.stop = True
    mt.end_processes(trainer)


if __name__ == "__main__":
    main()
