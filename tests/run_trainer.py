"""Runs the trainer's real code with a backend the test chooses, as a script, so that `accelerate
launch` can start it on several processes:

    python tests/run_trainer.py score SCRIPT.json OUT_DIR <trainer flags>
        one generation batch through the trainer's scoring path, with a scripted policy; process r
        rolls out the groups of the dataset rows listed for it in SCRIPT.json; writes OUT_DIR/rank-r.json
        (advantages, loss mask, rounds run, generate calls)
    python tests/run_trainer.py eval SCRIPT.json OUT_DIR <trainer flags>
        evaluation (run_evaluation) with the scripted policy; writes OUT_DIR/metrics.json (main process)
        and OUT_DIR/rank-r.json (this process's records and rounds)
    python tests/run_trainer.py stale <trainer flags>
        trains against the recipe's vLLM server with the weight reload skipped on purpose after the
        first sync (the server keeps the weights it had at the start)
    python tests/run_trainer.py stale_adapter base|first <trainer flags>
        LoRA adapter sync whose requests keep naming the base model, or the first adapter version
    python tests/run_trainer.py sharded SCRIPT.json OUT_DIR <trainer flags>
        trains (max_steps) with the scripted policy as an external sampler under top-p 0.9 / top-k 20, so that the
        importance weights score the samples with policy_sampler_logprobs, which the sampler reports as the starting
        policy's own (the first step's weights are 1); under `accelerate launch` with a DeepSpeed config on CPU
        (DS_ACCELERATOR=cpu), or on one process. Writes OUT_DIR/rank-r.json: its forwards and collectives
        (counted_collectives) and the steps it trained, and OUT_DIR/grad.pt (first_gradient)
    python tests/run_trainer.py inprocess SCRIPT.json OUT_DIR <trainer flags>
        trains (max_steps) with the in-process backend (`generation_backend: transformers`), its model.generate run for
        real but forced to write the script's turns (scripted_policy.ScriptedProcessing), so that the ranks' episodes
        end in the rounds the test chooses; then evaluates on the dataset's first row alone. Writes OUT_DIR/rank-r.json:
        the rows of each of its generate calls in training and in evaluation (0: it joined the others' decoding with
        a dummy row), the steps it trained and the episodes evaluated, and OUT_DIR/grad.pt (first_gradient)
    python tests/run_trainer.py fsdp2 MODEL_DIR OUT_DIR
        the trainer's forwards of one step (policy_sampler_logprobs under top-p / top-k, packed log-probs of rows split
        into samples under a token budget, an importance-weighted loss, its backward) on a model sharded by FSDP2
        (fully_shard over gloo), each process on its own rows of one global batch (sharded_batch); one process runs
        the whole batch unsharded. Writes OUT_DIR/rank-r.json (its forwards and collectives: counted_collectives) and,
        on the main process, OUT_DIR/grad.pt (the whole gradient)
    python tests/run_trainer.py budget CLOCKS.json <trainer flags with --max_train_minutes>
        trains as mt_grpo_trainer.py does, with the time budget reading a clock the test sets: process r's clock
        reads CLOCKS.json's list r at index global_step (seconds at the start of training, after step 1, ...)
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from mt_grpo_trainer import MTGRPOEnvTrainer, build_trainer, end_processes  # noqa: E402
from mt_grpo.run.reporting import TimeBudget  # noqa: E402
from scripted_policy import ScriptedTransformersBackend  # noqa: E402


def score(script_path: str, out_dir: str, flags: list[str]) -> MTGRPOEnvTrainer:
    with open(script_path) as f:
        spec = json.load(f)  # {"script": {question: variants}, "rows": [[row indices of rank 0], [rank 1], ...]}
    trainer = build_trainer(flags, backend_factory=lambda env: ScriptedTransformersBackend(env.tokenizer, spec["script"]))
    backend = trainer.backend
    rank = trainer.accelerator.process_index
    G = trainer.num_generations
    inputs = [dict(trainer.train_dataset[i]) for i in spec["rows"][rank] for _ in range(G)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"advantages": batch["advantages"].tolist(), "loss_mask": (batch["completion_mask"] * batch["tool_mask"]).tolist(),
                   "completion_ids": batch["completion_ids"].tolist(), "rounds": backend.rounds,
                   "generate_calls": backend.policy.calls,
                   "metrics": {k: v for k, v in trainer._metrics["train"].items() if k.startswith("dynamic_sampling/")}},
                  f)
    return trainer


def evaluate(script_path: str, out_dir: str, flags: list[str]) -> MTGRPOEnvTrainer:
    with open(script_path) as f:
        spec = json.load(f)
    trainer = build_trainer(flags, backend_factory=lambda env: ScriptedTransformersBackend(env.tokenizer, spec["script"]),
                            evaluation=True)
    metrics, records = trainer.run_evaluation()
    os.makedirs(out_dir, exist_ok=True)
    rank = trainer.accelerator.process_index
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"records": records, "rounds": trainer.backend.rounds}, f)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    return trainer


def stale(flags: list[str]) -> MTGRPOEnvTrainer:
    trainer = build_trainer(flags)
    client = trainer.backend
    reload = client.reload_weights_from_disk
    reloads = []

    def reload_once(folder):  # the bug under test: later reloads silently do nothing
        if not reloads:
            reload(folder)
        reloads.append(folder)
        client.reset_prefix_cache()

    client.reload_weights_from_disk = reload_once
    trainer.train()
    return trainer


def stale_adapter(kind: str, flags: list[str]) -> MTGRPOEnvTrainer:
    """LoRA adapter sync whose requests silently keep sampling the base model (`base`, verl #7495) or the
    first adapter version (`first`, kept loaded on purpose): the probe must stop the run."""
    trainer = build_trainer(flags)
    sync = trainer.backend.weights
    sync.config.max_adapters = 10  # the old versions stay loaded, so that nothing fails loudly
    inner, names = sync._sync_adapter, []

    def buggy(*args):
        metrics = inner(*args)
        names.append(sync.client.model_name)
        sync.client.model_name = sync.client.base_model_name if kind == "base" else names[0]
        return metrics

    sync._sync_adapter = buggy
    trainer.train()
    return trainer


COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_reduce")


def counted_collectives(model, counts: dict) -> None:
    """Count, into `counts`, the forwards of `model`, the collectives FSDP2 and ZeRO-3 call (all-gather,
    reduce-scatter, all-reduce), and each matched_forwards call's (this rank's forwards, the forwards made)."""
    import torch.distributed as dist

    from mt_grpo.engine import packing
    from mt_grpo.engine import sampling

    names = [n for n in COLLECTIVES if hasattr(dist, n)]  # torch 2.13's FSDP2 calls the *_single ones
    counts.update({"forwards": 0, "matched": [], **{n: 0 for n in names}})
    for name in names:
        def counted(*args, _name=name, _inner=getattr(dist, name), **kwargs):
            counts[_name] += 1
            return _inner(*args, **kwargs)
        setattr(dist, name, counted)
    inner = packing.matched_forwards

    def matched(items, device, count=None):
        own = list(items)  # the test's batches are small: built at once here, to be counted
        made = list(inner(own, device))
        counts["matched"].append((len(own), len(made)))
        return iter(made)

    packing.matched_forwards = sampling.matched_forwards = matched
    packing.unwrapped(model).register_forward_pre_hook(lambda *_: counts.__setitem__("forwards", counts["forwards"] + 1))


def sharded_batch(vocab: int):
    """One global batch of 4 rows (ids, attention, T, sample_starts): rows 0-1 one sample each, rows 2-3 split into
    three (tests/test_turn_samples.py's split_row, two seeds). Process r of 2 takes rows 2r, 2r+1: process 1 has
    three times the samples, and more tries under a budget of 40 tokens."""
    import torch
    from test_turn_samples import split_row

    parts = [split_row(vocab, seed) for seed in (0, 1)]
    ids = torch.cat([parts[0][0][1:], parts[1][0][1:], parts[0][0][:1], parts[1][0][:1]])
    att = torch.cat([parts[0][1][1:], parts[1][1][1:], parts[0][1][:1], parts[1][1][:1]])
    starts = torch.cat([parts[0][3][1:], parts[1][3][1:], parts[0][3][:1], parts[1][3][:1]])
    return ids, att, parts[0][2], starts


def first_gradient(trainer, path: str) -> None:
    """Save, on the main process, the first step's whole gradient (before clipping and the optimizer) to `path`:
    under DeepSpeed gathered from its partitions (safe_get_full_grad, on every rank) as the engine's step begins
    (accelerate's backward runs the step), else read after the first backward."""
    import torch

    saved = []

    def save(named):
        grads = {name: grad.detach().float().cpu().clone() for name, grad in named}
        if trainer.accelerator.is_main_process and not saved:
            torch.save(grads, path)
        saved.append(True)

    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_grad

        step = DeepSpeedEngine.step

        def first_step(engine, *args, **kwargs):
            if not saved:
                save((name, safe_get_full_grad(p)) for name, p in engine.module.named_parameters())
            return step(engine, *args, **kwargs)

        DeepSpeedEngine.step = first_step
    else:
        backward = trainer.accelerator.backward

        def first_backward(loss, **kwargs):
            backward(loss, **kwargs)
            if not saved:
                save((name, p.grad) for name, p in trainer.model.named_parameters())

        trainer.accelerator.backward = first_backward


def no_shm_all_reduce() -> None:
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        import deepspeed.ops  # its shared-memory all-reduce is a C++ op that compiled for 8+ minutes here: gloo's

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def sharded(script_path: str, out_dir: str, flags: list[str]) -> MTGRPOEnvTrainer:
    import torch
    from transformers import AutoModelForCausalLM

    from mt_grpo.engine.sampling import SamplingParams
    from scripted_policy import ScriptedSampler

    no_shm_all_reduce()
    with open(script_path) as f:
        script = json.load(f)["script"]
    params = SamplingParams(top_p=0.9, top_k=20)
    # loaded before the trainer's arguments turn ZeRO-3's partitioned loading on: the sampler's own, whole copy
    policy = AutoModelForCausalLM.from_pretrained(flags[flags.index("--model_name_or_path") + 1], dtype=torch.float32)
    trainer = build_trainer(flags, backend_factory=lambda env: ScriptedSampler(env.tokenizer, script, params, policy))
    counts = {}
    counted_collectives(trainer.model, counts)
    os.makedirs(out_dir, exist_ok=True)
    first_gradient(trainer, os.path.join(out_dir, "grad.pt"))
    trainer.train()
    with open(os.path.join(out_dir, f"rank-{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({**counts, "steps": trainer.state.global_step}, f)
    return trainer


def inprocess(script_path: str, out_dir: str, flags: list[str]) -> MTGRPOEnvTrainer:
    from mt_grpo.engine import sampling
    from scripted_policy import ScriptedPolicy, ScriptedProcessing

    no_shm_all_reduce()
    with open(script_path) as f:
        script = json.load(f)["script"]
    trainer = build_trainer(flags)
    ScriptedProcessing.policy = ScriptedPolicy(trainer.env.tokenizer, script)
    sampling.SamplerProcessing = ScriptedProcessing
    backend, calls = trainer.backend, []
    generate = backend.generate

    def counted(prompts, max_tokens, n=1, params=None):
        calls.append(len(prompts) * n)
        return generate(prompts, max_tokens, n, params)

    backend.generate = counted
    os.makedirs(out_dir, exist_ok=True)
    first_gradient(trainer, os.path.join(out_dir, "grad.pt"))
    trainer.train()
    trained = len(calls)
    # evaluation on the first question alone: the other rank's chunk is empty
    metrics, _ = trainer.run_evaluation(trainer.train_dataset.select([0]))
    with open(os.path.join(out_dir, f"rank-{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({"calls": calls[:trained], "eval_calls": calls[trained:], "steps": trainer.state.global_step,
                   "eval_episodes": metrics["eval/episodes"]}, f)
    return trainer


def fsdp2(model_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from mt_grpo.engine.sampling import SamplingParams, policy_sampler_logprobs
    from mt_grpo.engine.packing import packed_logps_and_entropies

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    counts = {}
    if world > 1:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        counted_collectives(model, counts)
    ids, att, T, starts = sharded_batch(model.config.vocab_size)
    tokens = att[:, -T:].sum()  # the global batch's, as TRL's dapo normaliser
    rows = slice(2 * rank, 2 * rank + 2) if world > 1 else slice(None)
    ids, att, starts = ids[rows], att[rows], starts[rows]
    P = ids.shape[1] - T
    with torch.no_grad():  # pi_trainer of the importance weights, under the sampler's truncation
        trainer_sampler = policy_sampler_logprobs(model, ids[:, :P], att[:, :P], ids[:, P:], att[:, P:],
                                                  SamplingParams(temperature=1.0, top_p=0.9, top_k=20), starts)
    logps, _, _ = packed_logps_and_entropies(model, ids, att, T, 40, sample_starts=starts)
    weights = torch.exp(trainer_sampler - (-0.5)).clamp(max=2.0) * att[:, P:]  # the sampler said -0.5 a token
    advantages = torch.linspace(-1.0, 1.0, 4)[rows, None]
    # FSDP2 averages the processes' gradients: each process's share of the global mean, times the processes
    loss = -(advantages * weights * torch.exp(logps - logps.detach())).sum() / tokens * world
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
             for n, p in model.named_parameters()}
    os.makedirs(out_dir, exist_ok=True)
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, "grad.pt"))
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(counts, f)
    if world > 1:
        dist.destroy_process_group()


def budget(clocks_path: str, flags: list[str]) -> MTGRPOEnvTrainer:
    """A run of main()'s steps whose TimeBudget reads the test's clock for this process, not the wall clock:
    the test decides after which step the budget is passed, whatever the machine's speed."""
    trainer = build_trainer(flags)
    with open(clocks_path) as f:
        seconds = json.load(f)[trainer.accelerator.process_index]
    (time_budget,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, TimeBudget)]
    time_budget.clock = lambda: seconds[trainer.state.global_step]
    trainer.train()
    trainer.save_model(trainer.args.output_dir)
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    if sys.argv[1] == "score":
        trainer = score(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "eval":
        trainer = evaluate(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "stale":
        trainer = stale(sys.argv[2:])
    elif sys.argv[1] == "stale_adapter":
        trainer = stale_adapter(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "sharded":
        trainer = sharded(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "inprocess":
        trainer = inprocess(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "fsdp2":
        fsdp2(sys.argv[2], sys.argv[3])
        raise SystemExit(0)
    elif sys.argv[1] == "budget":
        trainer = budget(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)
    end_processes(trainer)  # without it a rank can abort at exit (see end_processes)
