"""Evaluation for MTGRPOEnvTrainer, whose `evaluate` and `run_evaluation` call these with the stages they use:
multi-turn episodes on the eval set (greedy, or k samples for pass@k), scored by the trainer's own scoring stage
and the task's metrics, logged as `eval/...`. What they read of the trainer is public: TRL's and transformers'
attributes (args, state, model, accelerator, control, callback_handler, eval_dataset), the trainer's env, backend and
reward lists, and TrainerReports' write_records and take_reward_logs (reporting.py); its private stages come in as
arguments."""

import math
from typing import Callable

from accelerate.utils import gather_object
from trl import GRPOTrainer

from mt_grpo.engine.sampling import GREEDY
from mt_grpo.rewards.judge import judge_metrics
from mt_grpo.rollout.environments import episode_columns
from mt_grpo.run.reporting import applicable_mean, episode_records, eval_metrics, rewards_by_name


def evaluate(trainer, eval_dataset=None) -> dict[str, float]:
    """Multi-turn episodes on the eval set with no gradient, logged as `eval/...` metrics (`trainer`: the trainer)."""
    metrics, records = trainer.run_evaluation(eval_dataset)
    if trainer.args.save_rollouts_steps:
        trainer.write_records(f"eval-step-{trainer.state.global_step:06d}.jsonl", records)
    # transformers' log, not TRL's: TRL's would merge (and clear) the training metrics gathered so far
    super(GRPOTrainer, trainer).log(dict(metrics))
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    # also under transformers' `eval_` names, which metric_for_best_model (check_best_metric) looks up
    return {**metrics, **{f"eval_{k.removeprefix('eval/')}": v for k, v in metrics.items()}}


def run_evaluation(trainer, dataset, *, sync: Callable, score: Callable, progress: bool,
                   async_rollouts=None) -> tuple[dict[str, float], list[dict]]:
    """(metrics, per-episode records) on `dataset` (default: the eval set). Greedy decoding, one
    episode per question, unless `num_generations_eval` k > 1: then k episodes sampled as in
    training, and pass@k. Questions are spread over the processes; every process gets the metrics.
    Rewards as in training (`score`, the trainer's scoring stage, on this process's episodes), and the task's own
    metrics. `sync`: gives the sampler the policy; `progress`: show the rollouts' progress bar; `async_rollouts`: the
    trainer's AsyncRollouts (async_rollout), whose request in flight is waited for before the sync."""
    dataset = trainer.eval_dataset if dataset is None else dataset
    if dataset is None:
        raise ValueError("No evaluation set: set `eval_strategy: steps` (with `eval_steps`) so that the "
                         "trainer loads one, or pass a dataset.")
    k = trainer.args.num_generations_eval or 1
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        if async_rollouts is not None:
            async_rollouts.wait()  # no weight sync while a background request is in flight
        sync()  # the vLLM server evaluates the current policy
        inputs, episodes = eval_episodes(trainer, dataset, k, progress)
    finally:
        trainer.model.train(was_training)
    prompts, completions = [x["prompt"] for x in inputs], [ep.messages for ep in episodes]
    columns = episode_columns(inputs, episodes)
    scores = score(prompts, episodes, inputs, all_processes=False,
                   turns=1 + max([0, *(ep.tool_turns for ep in episodes)]))  # the final model turn's too
    funcs = trainer.turn_reward_funcs + trainer.outcome_reward_funcs
    judged = {f"eval/{name}": value for name, value in judge_metrics(funcs).items()}  # this process's judge work
    # what rewards logged through TRL's log_metric (this process's; log_extra's columns belong to training's table)
    _, logged = trainer.take_reward_logs()
    judged.update({f"eval/{name}": sum(v) / len(v) for name, v in logged.items() if v})
    task = {name: fn(prompts, completions, **columns) if inputs else []
            for name, fn in trainer.eval_metric_funcs.items()}
    rows = slice(0, len(episodes))
    rewards = rewards_by_name(scores, rows, episodes, trainer.turn_reward_funcs, trainer.outcome_reward_funcs)
    results = [{"question": x["row"], "metrics": {name: values[i] > 0 for name, values in task.items()},
                "answered": ep.stop_reason == "answer", "tool_calls": len(ep.calls),
                "tool_failures": ep.tool_failures,
                "rewards": {**{f"turn/{fn.__name__}": applicable_mean(scores.turn_per_func[i, f])
                               for f, fn in enumerate(trainer.turn_reward_funcs)},
                            **{f"outcome/{fn.__name__}": scores.outcome_per_func[i, f].item()
                               for f, fn in enumerate(trainer.outcome_reward_funcs)}}}
               for i, (x, ep) in enumerate(zip(inputs, episodes))]
    trainer.env.release(episodes)  # their environment instances, if any, serve the next episodes
    all_results = gather_object(results) if trainer.accelerator.num_processes > 1 else results
    records = episode_records(trainer.env.tokenizer, episodes, inputs, step=trainer.state.global_step, mode="eval",
                              first_index=0, group_size=k, rewards=rewards, token_values={})
    for record, result in zip(records, results):
        record["group"] = result["question"]  # the question's row in the eval set
    return {**eval_metrics(all_results, k), **judged}, records


def eval_episodes(trainer, dataset, k: int, progress: bool = False) -> tuple[list[dict], list]:
    """This process's questions (every world_size-th row), k episodes each, in rollouts of at most
    per_device_eval_batch_size episodes. Every process runs the same number of rollouts (some may be
    empty), as lock-step generation needs. `progress`: show the rollouts' progress bar."""
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    rows = [{**dataset[i], "row": i} for i in range(rank, len(dataset), world)]
    inputs = [row for row in rows for _ in range(k)]
    per_rollout = max(k, trainer.args.per_device_eval_batch_size // k * k)
    rollouts = math.ceil(math.ceil(len(dataset) / world) * k / per_rollout)
    params = GREEDY if k == 1 else None  # None: the training sampling parameters
    episodes = []
    for r in range(rollouts):
        chunk = inputs[r * per_rollout : (r + 1) * per_rollout]
        episodes += trainer.env.rollout([x["prompt"] for x in chunk], trainer.backend, params,
                                     progress=progress, rows=chunk)
    for ep in episodes:
        ep.policy_version = trainer.state.global_step
    return inputs, episodes
