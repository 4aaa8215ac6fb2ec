"""Evaluation for MTGRPOEnvTrainer (a base class of it, as reporting.TrainerReports is, kept here to keep the
trainer file about the algorithm): multi-turn episodes on the eval set, scored by the trainer's own scoring
stage (`_score`) and the task's metrics, logged as `eval/...`. The episodes come from the trainer's
`_eval_episodes` (greedy, or k samples for pass@k)."""

from accelerate.utils import gather_object
from trl import GRPOTrainer

from reporting import _nanmean, episode_records, eval_metrics
from environments import episode_columns


class TrainerEvaluation:
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval") -> dict[str, float]:
        """Multi-turn episodes on the eval set with no gradient, logged as `eval/...` metrics; what
        `eval_strategy` runs. Replaces TRL's evaluation loop, which scores single-turn completions."""
        metrics, records = self.run_evaluation(eval_dataset)
        if self.script_args.save_rollouts_steps:
            self._write_records(f"eval-step-{self.state.global_step:06d}.jsonl", records)
        # transformers' log, not TRL's: TRL's would merge (and clear) the training metrics gathered so far
        super(GRPOTrainer, self).log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        # also under transformers' `eval_` names, which metric_for_best_model (check_best_metric) looks up
        return {**metrics, **{f"eval_{k.removeprefix('eval/')}": v for k, v in metrics.items()}}

    def run_evaluation(self, dataset=None) -> tuple[dict[str, float], list[dict]]:
        """(metrics, per-episode records) on `dataset` (default: the eval set). Greedy decoding, one
        episode per question, unless `num_generations_eval` k > 1: then k episodes sampled as in
        training, and pass@k. Questions are spread over the processes; every process gets the metrics.
        Rewards as in training (`_score`, on this process's episodes), and the task's own metrics."""
        dataset = self.eval_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError("No evaluation set: set `eval_strategy: steps` (with `eval_steps`) so that the "
                             "trainer loads one, or pass a dataset.")
        k = self.args.num_generations_eval or 1
        was_training = self.model.training
        self.model.eval()
        try:
            if self._async is not None:
                self._async.wait()  # no weight sync while a background request is in flight
            self._sync_weights()  # the vLLM server evaluates the current policy
            inputs, episodes = self._eval_episodes(dataset, k)
        finally:
            self.model.train(was_training)
        prompts, completions = [x["prompt"] for x in inputs], [ep.messages for ep in episodes]
        columns = episode_columns(inputs, episodes)
        scores = self._score(prompts, episodes, inputs, all_processes=False,
                             turns=max([1, *(ep.tool_turns for ep in episodes)]))
        judged = {f"eval/{name}": value for name, value in self._judge_metrics().items()}  # this process's judge work
        # what rewards logged through TRL's log_metric (this process's; log_extra's columns belong to training's table)
        judged.update({f"eval/{name}": sum(v) / len(v) for name, v in self._pending_metrics.items() if v})
        self._pending_metrics.clear()
        self._pending_extra_logs.clear()
        task = {name: fn(prompts, completions, **columns) if inputs else []
                for name, fn in self.eval_metric_funcs.items()}
        rows = slice(0, len(episodes))
        rewards = self._rewards_by_name(scores, rows, episodes)
        results = [{"question": x["row"], "metrics": {name: values[i] > 0 for name, values in task.items()},
                    "answered": ep.stop_reason == "answer", "tool_calls": len(ep.calls),
                    "tool_failures": ep.tool_failures,
                    "rewards": {**{f"turn/{fn.__name__}": _nanmean(scores.turn_per_func[i, f])
                                   for f, fn in enumerate(self.turn_reward_funcs)},
                                **{f"outcome/{fn.__name__}": scores.outcome_per_func[i, f].item()
                                   for f, fn in enumerate(self.outcome_reward_funcs)}}}
                   for i, (x, ep) in enumerate(zip(inputs, episodes))]
        self.env.release(episodes)  # their environment instances, if any, serve the next episodes
        all_results = gather_object(results) if self.accelerator.num_processes > 1 else results
        records = episode_records(self.env.tokenizer, episodes, inputs, step=self.state.global_step, mode="eval",
                                  first_index=0, group_size=k, rewards=rewards, token_values={})
        for record, result in zip(records, results):
            record["group"] = result["question"]  # the question's row in the eval set
        return {**eval_metrics(all_results, k), **judged}, records
