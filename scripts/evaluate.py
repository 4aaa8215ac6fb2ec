"""Evaluate a model folder or a checkpoint on a held-out split, without training: multi-turn episodes
with the recipe's env, tools and rewards (greedy, or pass@k with --num_generations_eval k).

    python scripts/evaluate.py --config hf_recipes/SmolLM2-135M-Instruct/cpu_demo.yaml \
        --model_name_or_path outputs/cpu_demo/checkpoint-30 --output_dir outputs/eval-step30 [--eval_max_samples 64]

Every recipe field works as a flag (`--eval_dataset_split test`, `--generation_backend vllm_server`, ...).
Writes <output_dir>/eval_episodes.jsonl (one record per episode: question, answers, turns, tool calls,
reward values; scripts/view_rollouts.py shows them) and <output_dir>/eval_summary.json, and prints the
metrics as a table.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mt_grpo_trainer import build_trainer, end_processes  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    trainer = build_trainer(argv, evaluation=True)
    metrics, records = trainer.run_evaluation()
    out = trainer.args.output_dir
    trainer.write_records("eval_episodes.jsonl", records, folder=out)
    if trainer.accelerator.is_main_process:
        summary = {"model": trainer.model.name_or_path, "dataset": trainer.args.eval_dataset_name
                   or trainer.args.dataset_name, "metrics": metrics}
        with open(os.path.join(out, "eval_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        width = max(len(k) for k in metrics)
        print(f"\n{'metric'.ljust(width)} | value\n{'-' * width}-|------")
        for key, value in metrics.items():
            print(f"{key.ljust(width)} | {value:.4f}")
        print(f"\nwrote {os.path.join(out, 'eval_episodes.jsonl')} and eval_summary.json")
    end_processes(trainer)
    return metrics


if __name__ == "__main__":
    main()
