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
from reporting import TimeBudget  # noqa: E402
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
    elif sys.argv[1] == "budget":
        trainer = budget(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)
    end_processes(trainer)  # without it a rank can abort at exit (see end_processes)
