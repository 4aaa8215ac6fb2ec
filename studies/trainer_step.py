"""Trainer step: MTGRPOEnvTrainer against TRL's GRPOTrainer on identical token batches (same tiny
model, lengths and batch), and peak memory for SmolLM2-135M with and without chunked logprobs.

    .venv/bin/python studies/trainer_step.py

Timed per step: advantages (TRL: one per sequence; ours: group-normalised turn and outcome
advantages assigned per token, vectorised) + the clipped loss + backward. Both trainers use TRL's
loss; what differs is per-token advantages and the env mask.
"""

import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from common import print_table, smollm2_dir
from datasets import Dataset
from prepare_models import make_tiny_model
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from mt_grpo_trainer import AdvantageSettings, MTGRPOEnvTrainer, MTGRPOScriptArguments, MultiTurnToolEnv, mt_grpo_advantages
from mt_grpo.engine.sampling import TransformersBackend, SamplingParams
from mt_grpo.base.protocol import XMLProtocol

B, P, T, G = 16, 128, 256, 4


def reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def trainers(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]] * B})
    args = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=B, num_generations=G, max_completion_length=T,
                report_to="none", use_cpu=True, bf16=False, beta=0.0, loss_type="dapo", disable_tqdm=True,
                activation_checkpointing=False)
    trl = GRPOTrainer(model=model_dir, reward_funcs=[reward], args=GRPOConfig(**args), train_dataset=ds, processing_class=tokenizer)
    env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[], max_env_steps=2, max_tokens_per_turn=64,
                           max_completion_length=T, max_tool_response_tokens=64)
    backend = TransformersBackend(tokenizer=tokenizer, params=SamplingParams(), eos_token_ids=[tokenizer.eos_token_id],
                                  stop_strings=env.protocol.stop_strings)
    ours = MTGRPOEnvTrainer(model=model_dir, env=env, backend=backend, turn_reward_funcs=[reward], outcome_reward_funcs=[reward],
                            args=GRPOConfig(**args), script_args=MTGRPOScriptArguments(max_tokens_per_turn=64, max_tool_response_tokens=64),
                            train_dataset=ds, processing_class=tokenizer)
    for t in (trl, ours):  # set by Trainer.train(); the benchmark calls the loss directly
        t.current_gradient_accumulation_steps = 1
    return trl, ours


def batch(vocab):
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(T // 4, T, (B,), generator=g)  # first <result> offset
    model_mask = torch.ones(B, T, dtype=torch.long)
    turns = torch.zeros(B, T, dtype=torch.long)  # model turn of each token: 0 before the first <result>
    for i, s in enumerate(starts):  # a 32-token env reply after the first turn
        model_mask[i, s : s + 32] = 0
        turns[i, s : s + 32] = -1
        turns[i, s + 32 :] = 1
    return {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, T), generator=g), "completion_mask": torch.ones(B, T, dtype=torch.long),
        "num_items_in_batch": model_mask.sum(),
    }, model_mask, turns, torch.rand(B, generator=g), torch.rand(B, generator=g)


def step(trainer, inputs, multi_turn, model_mask, turns, R_T, R_O):
    if multi_turn:
        inputs = {**inputs, "advantages": mt_grpo_advantages(R_T, R_O, turns, AdvantageSettings.of("mt_grpo", G, turn_advantage_coef=1.0)).tokens, "tool_mask": model_mask}
    else:  # TRL's sequence-level advantage, as its _generate_and_score_completions computes it
        r = R_O.view(-1, G)
        inputs = {**inputs, "advantages": ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)}
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    trainer.model.zero_grad(set_to_none=True)


def time_steps(repeats=12):
    model_dir = make_tiny_model(tempfile.mkdtemp(prefix="bench-tiny-"))
    trl, ours = trainers(model_dir)
    inputs, model_mask, turns, R_T, R_O = batch(trl.model.config.vocab_size)
    runs = {"TRL GRPOTrainer": (trl, False), "MTGRPOEnvTrainer": (ours, True)}
    times = {name: [] for name in runs}
    for name, (tr, mt) in runs.items():  # warm-up
        tr.model.train()
        step(tr, inputs, mt, model_mask, turns, R_T, R_O)
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for name, (tr, mt) in runs.items():
            t0 = time.perf_counter()
            step(tr, inputs, mt, model_mask, turns, R_T, R_O)
            times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    t0 = time.perf_counter()
    for _ in range(100):
        mt_grpo_advantages(R_T, R_O, turns, AdvantageSettings.of("mt_grpo", G, turn_advantage_coef=1.0))
    adv_us = (time.perf_counter() - t0) / 100 * 1e6
    base = med["TRL GRPOTrainer"]
    print_table(f"Trainer step, tiny Qwen2, batch {B} x (prompt {P} + completion {T}), median of {repeats}",
                ["trainer", "ms/step", "vs TRL"], [[k, v * 1000, f"{(v / base - 1) * 100:+.1f}%"] for k, v in med.items()])
    print(f"\nper-token advantage assignment (mt_grpo_advantages, (B, T) = ({B}, {T})): {adv_us:.0f} us")


def memory_worker(mode, n=8, length=1024):
    """One forward + backward of SmolLM2 on n x length tokens; prints peak RSS (MiB)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (n, length))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "chunked":  # what the trainer runs: TRL's fused LM head scores tokens in tiles
        add_fused_lm_head(model)
        logps = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    else:  # the naive way: full (n, length, vocab) logits, then a full log_softmax
        logps = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logps.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{before / 1024:.0f} {peak / 1024:.0f}")


def memory():
    rows = []
    for mode in ("full", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--memory-worker", mode], capture_output=True, text=True, check=True)
        before, peak = map(float, out.stdout.split()[-2:])
        rows.append([mode, round(before), round(peak), round(peak - before)])
    print_table("Peak memory, SmolLM2-135M, forward + backward on 8 x 1024 tokens (MiB, RSS)",
                ["logprobs", "after load", "peak", "peak - load"], rows)


if __name__ == "__main__":
    if "--memory-worker" in sys.argv:
        memory_worker(sys.argv[sys.argv.index("--memory-worker") + 1])
    else:
        torch.manual_seed(0)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        time_steps()
        memory()
