"""What a run reports: rollout and eval metrics, episode records (scripts/view_rollouts.py reads them),
the console (progress bars on a terminal, one line per step, closing lines naming what the run left), the
SIGTERM stop and the time budget. Episodes are read by their attributes (mt_grpo_trainer.Episode); nothing
here changes what is trained."""

import dataclasses
import json
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from accelerate.utils import broadcast, gather, gather_object
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from mt_grpo.agents import agent_metrics
from mt_grpo.base.fields import arg
from mt_grpo.base.runtime import STOP, StopRequested
from mt_grpo.engine.vision import content_images, conversation_images, json_image, thumbnail
from mt_grpo.rewards.conversation import env_replies
from mt_grpo.rollout.user_turns import continued
from mt_grpo.rewards import is_per_tool_turn
from mt_grpo.rewards.judge import judge_metrics

logger = logging.getLogger("mt_grpo")


def watched() -> bool:
    """Whether progress bars are seen as bars: stderr is a terminal, or tqdm draws notebook widgets."""
    from tqdm import auto

    return auto.notebook_tqdm is not auto.std_tqdm or sys.stderr.isatty()


def progress_bar(**kwargs):
    r"""A tqdm bar where someone watches it (`watched`). Where stderr is a file or a pipe (a job's log) it is
    off: each redraw would leave a `\r` line there, and the nested rollout bar tqdm's cursor-up `\x1b[A`;
    StepPrinter's one line per step is then the run's progress."""
    from tqdm import auto

    return auto.tqdm(dynamic_ncols=True, disable=not watched(), **kwargs)


def quiet_library_bars() -> None:
    """Where no one watches (`watched`), the libraries' bars off too: transformers' "Loading weights" and
    "Writing model shards", the hub's downloads, datasets' map. Process-wide; call it once, before loading."""
    if not watched():
        import datasets
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # and the hub's
        datasets.disable_progress_bars()


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the trainer's log lines, a recipe's run or a script


def show_log() -> None:
    """The trainer's INFO lines (the advantage mode `auto` chose and how to add turn credit, the step's warnings)
    on stderr in a Python script too, as main()'s basicConfig shows them for a recipe; unless the program has set
    up logging itself (a handler on the root logger or on "mt_grpo"). Python alone shows only warnings."""
    log = logging.getLogger("mt_grpo")
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)


class RolloutProgress:
    """A tqdm bar of finished episodes, with the tool calls in flight; nothing when off or not on a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.bar = progress_bar(total=total, desc="rollout", unit="episode", leave=False) if enabled else None

    def update(self, episodes: list, tool_calls: int) -> None:
        if self.bar is not None:
            self.bar.n = sum(ep.done for ep in episodes)
            self.bar.set_postfix_str(f"tool calls in flight: {tool_calls}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

EPISODE_STATS = ("tool_calls", "tool_failures", "model_tokens", "env_tokens", "truncated", "answered",
                 "tokenization_mismatch", "turns", "samples", "user_turns", "prompt_tokens", "images")
STOP_REASONS = ("answer", "no_action", "max_env_steps", "turn_length", "budget", "repetition", "reset_timeout",
                "env_done", "env_error", "max_assistant_turns", "agent_done", "agent_error", "agent_timeout", "no_call")
# The stop reasons that are a limit cutting the episode, and the field to raise
LIMITS = {"max_env_steps": "`max_env_steps` (or TRL's `max_tool_calling_iterations`)",
          "turn_length": "`max_tokens_per_turn`", "budget": "`max_completion_length`",
          "reset_timeout": "`reset_timeout` (or a reset that hangs: see the log)",
          "max_assistant_turns": "`verl_max_assistant_turns`", "agent_timeout": "`agent_timeout`"}


def warn_limit(trainer, metric: str, share: float) -> None:
    """Once per limit and run: a warning when a limit ended most episodes of a step (`rollout/stop/<reason>`)."""
    reason = metric.removeprefix("rollout/stop/")
    warned = trainer.__dict__.setdefault("_limits_warned", set())
    if reason in LIMITS and share > 0.5 and reason not in warned and trainer.accelerator.is_main_process:
        warned.add(reason)
        logger.warning("%.0f%% of this step's episodes were cut by %s (rollout/stop/%s): raise it if the episodes "
                       "need more.", 100 * share, LIMITS[reason], reason)


def model_turns(spans: list) -> int:
    """The model's turns: its spans, but for those that continue a turn after a continuation's text (user_turns.py)."""
    return sum(s.role == "model" and not continued(spans, k) for k, s in enumerate(spans))


def episode_stats(episodes: list) -> torch.Tensor:
    """(B, len(EPISODE_STATS) + len(STOP_REASONS)) per-episode numbers, gathered once per batch."""
    rows = []
    for ep in episodes:
        model_tokens = sum(ep.model_mask)
        rows.append([len(ep.calls), ep.tool_failures, model_tokens, len(ep.completion_ids) - model_tokens,
                     ep.truncated, ep.stop_reason == "answer", ep.tokenization_mismatch,
                     model_turns(ep.spans), 1 + len(ep.sample_starts), ep.user_turns, len(ep.prompt_ids),
                     len(conversation_images(getattr(ep, "prompt_messages", []) + ep.messages))]
                    + [ep.stop_reason == r for r in STOP_REASONS])
    return torch.tensor(rows, dtype=torch.float32).view(-1, len(EPISODE_STATS) + len(STOP_REASONS))


def rollout_metrics(stats: torch.Tensor) -> dict[str, float]:
    """`rollout/...` metrics from gathered episode_stats rows."""
    s = dict(zip(EPISODE_STATS, stats[:, : len(EPISODE_STATS)].T))
    calls = s["tool_calls"].sum()
    out = {
        "rollout/tool_calls_per_episode": s["tool_calls"].mean().item(),
        "rollout/tool_success_rate": ((1 - s["tool_failures"].sum() / calls).item() if calls > 0
                                      else float("nan")),
        "rollout/turns_per_episode": s["turns"].mean().item(),
        "rollout/model_tokens": s["model_tokens"].mean().item(),
        "rollout/env_tokens": s["env_tokens"].mean().item(),
        "rollout/truncated_ratio": s["truncated"].mean().item(),
        "rollout/answered_ratio": s["answered"].mean().item(),
        "rollout/tokenization_mismatch_ratio": s["tokenization_mismatch"].mean().item(),
        "rollout/samples_per_episode": s["samples"].mean().item(),  # turn_samples.py; 1: none split
        "rollout/user_turns_per_episode": s["user_turns"].mean().item(),  # an environment's replies (user_turns.py)
    }
    if s["images"].sum() > 0:  # a run with images (engine/vision.py): the prompt's and the replies'
        out["rollout/images_per_episode"] = s["images"].mean().item()
    for i, reason in enumerate(STOP_REASONS):
        out[f"rollout/stop/{reason}"] = stats[:, len(EPISODE_STATS) + i].mean().item()
    return out


def _number(x) -> float | None:
    """A JSON-friendly reward: NaN ("not applicable") becomes None."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def applicable_mean(x: torch.Tensor) -> float:
    """The mean of x's values that apply (NaN: not applicable, as a reward's None), NaN when none does."""
    return torch.nanmean(x).item() if not torch.isnan(x).all() else float("nan")


def episode_value(values: torch.Tensor | None, i: int, turns: int):
    """Episode i's value as its record holds it: row i of a (B,) or (B, 1) tensor as a number, or of a (B, K)
    per-turn tensor as a list of its first `turns` values (turns_scored); None when absent."""
    if values is None:
        return None
    row = values[i].reshape(-1).tolist()
    return _number(row[0]) if len(row) == 1 else [_number(x) for x in row[:turns]]


def turns_scored(R_T: torch.Tensor | None, i: int, tool_turns: int) -> int:
    """How many of episode i's per-turn values are its own: one per tool turn it took, one for an episode without a
    tool call, whose first turn is credited like any other (mt_grpo_trainer.turn_reward_table: its tokens got A_O +
    A_T(0)), and one for the final model turn where a reward scored it (R_T holds a value past the tool turns)."""
    row = [] if R_T is None else R_T[i].reshape(-1).tolist()
    final = tool_turns < len(row) and not math.isnan(row[tool_turns])
    return max(tool_turns + final, 1)


def reward_metrics(scores, signal: torch.Tensor, turn_funcs: list[Callable], outcome_funcs: list[Callable],
                   prefix: str = "") -> dict[str, float]:
    """`rewards/...` metrics of scored rows (the trainer's Scores): each function's mean, the means of R_T and
    R_O, and the share of groups without signal; `signal`: (groups,) bool, True where a group gives some token
    a non-zero advantage. `prefix` names rows other than the trained batch's; no rows give NaN."""
    out = {}
    for kind, funcs, per_func, R in (("turn", turn_funcs, scores.turn_per_func, scores.R_T),
                                     ("outcome", outcome_funcs, scores.outcome_per_func, scores.R_O)):
        for i, fn in enumerate(funcs):
            out[f"{prefix}rewards/{kind}/{fn.__name__}"] = applicable_mean(per_func[:, i])
        out[f"{prefix}rewards/{kind}/mean"] = applicable_mean(R)
    out[f"{prefix}rewards/frac_zero_signal_groups"] = 1 - signal.float().mean().item() if len(signal) else math.nan
    return out


def per_sample_rewards(scores) -> torch.Tensor:
    """(B, F) each function's value per sample, turn functions first (TRL's `reward_func_names` order): a per-turn
    function's is the mean over the sample's tool turns. What TRL's completions table and `rewards/<func>/...` show."""
    return torch.cat([torch.nanmean(scores.turn_per_func, dim=2), scores.outcome_per_func], dim=1)


def trl_metrics(stats: torch.Tensor, per_func: torch.Tensor, weights: torch.Tensor, names: list[str],
                group_size: int, scale_rewards: str, tools: bool) -> dict[str, float]:
    """TRL 1.16's metrics of a generation batch (GRPOTrainer._generate_and_score_completions), by its names and
    definitions, beside ours, so that what reads a TRL run reads this one. `stats`: gathered episode_stats rows;
    `per_func`: per_sample_rewards; `weights`: (F,) each function's weight; `tools`: the run has tools (TRL logs
    `tools/...` only then). `reward` is the weighted sum of every function, turn ones included (TRL's GRPO trains
    on it; here it is logged, and the advantages are MT-GRPO's). A function named `turn` or `outcome` keeps only our
    `rewards/<kind>/...` names."""
    from trl.trainer.utils import nanstd

    out = {}
    for i, name in enumerate(names):
        if name not in ("turn", "outcome"):
            out[f"rewards/{name}/mean"] = applicable_mean(per_func[:, i])
            out[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    reward = (per_func * weights.to(per_func.device)[None, :]).nansum(dim=1)
    reward[torch.isnan(per_func).all(dim=1)] = float("nan")  # unscorable: every function returned None
    out["reward"], out["reward_std"] = applicable_mean(reward), nanstd(reward).item()
    std = nanstd(reward) if scale_rewards == "batch" else nanstd(reward.view(-1, group_size), dim=1) \
        if group_size > 1 else torch.zeros(1)
    out["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    s = dict(zip(EPISODE_STATS, stats[:, : len(EPISODE_STATS)].T))
    lengths, clipped = s["model_tokens"], s["truncated"].bool()  # TRL counts model tokens (tool_mask) too
    ended = lengths[~clipped] if (~clipped).any() else torch.zeros(1)
    for kind, values in (("", lengths), ("_terminated", ended)):
        out[f"completions/mean{kind}_length"] = values.mean().item()
        out[f"completions/min{kind}_length"] = values.min().item()
        out[f"completions/max{kind}_length"] = values.max().item()
    out["completions/clipped_ratio"] = clipped.float().mean().item()
    if tools:
        calls = s["tool_calls"].sum()
        out["tools/call_frequency"] = (calls / len(stats)).item()
        out["tools/failure_frequency"] = (s["tool_failures"].sum() / calls).item() if calls > 0 else 0.0
    return out


def rolled_out_rows(passes: list, group_size: int) -> tuple:
    """(Scores, (groups,) signal) of the groups each scoring pass rolled out, stacked in pass order. `passes`:
    (the trainer's Scores of the whole batch, its (groups,) signal, the groups that pass rolled out) each."""
    first = passes[0][0]
    rows = [(torch.tensor(groups, dtype=torch.long)[:, None] * group_size + torch.arange(group_size)).flatten()
            .to(first.R_O.device) for _, _, groups in passes]  # each pass's rows: its groups', group-major
    # per_turn: a pass has a column per tool turn of its longest episode; fewer columns are padded with NaN (no turn)
    K = max(scores.R_T.shape[-1] for scores, _, _ in passes)
    pad = lambda x, name: torch.nn.functional.pad(x, (0, K - x.shape[-1]), value=float("nan")) \
        if name in ("turn_per_func", "R_T") else x  # noqa: E731
    stacked = {f.name: torch.cat([pad(getattr(scores, f.name), f.name)[r] for (scores, _, _), r in zip(passes, rows)])
               for f in dataclasses.fields(first)}
    return type(first)(**stacked), torch.cat([signal[groups] for _, signal, groups in passes])


def episode_records(tokenizer, episodes: list, inputs: list[dict], *, step: int, mode: str,
                    first_index: int, group_size: int, rewards: dict[str, dict[str, list]],
                    token_values: dict[str, torch.Tensor | None], R_T=None, R_O=None, A_T=None,
                    A_O=None, advantage_mode: str | None = None) -> list[dict]:
    """One JSON-ready record per episode, as scripts/view_rollouts.py reads them (docs/guide.md: "Looking
    at rollouts and runs" lists every field): the turns (an env turn with the calls it answers and their
    outputs), every completion token with its mask and per-token values, rewards, advantages and the
    episode's tool calls. `first_index` is the first episode's index in the generation batch."""
    records = []
    for i, (ep, row) in enumerate(zip(episodes, inputs)):
        n = len(ep.completion_ids)
        turns, model_turn, env_turn = [], -1, -1
        starts = [start for start, _ in getattr(ep, "sample_starts", [])]  # turn_samples.py
        environment = getattr(getattr(ep, "toolset", None), "environment", None)  # environments.py
        replies = env_replies(ep.messages)  # each env turn's messages, in order
        for k, span in enumerate(ep.spans):
            turn = {"role": span.role, "start": span.start, "end": span.end,
                    "text": tokenizer.decode(ep.completion_ids[span.start : span.end])}
            if span.role == "model":
                model_turn += not continued(ep.spans, k)  # a continued turn is one turn
            elif span.role == "env":
                env_turn += 1
                turn["tool_calls"] = [dataclasses.asdict(c) for c in ep.calls if c.turn == model_turn]
                if images := [thumbnail(im) for m in replies[env_turn] for im in content_images(m.get("content"))]:
                    turn["images"] = images  # the images this reply brought, where they entered
                if environment is not None and env_turn < len(ep.toolset.turn_rewards):
                    turn["step_rewards"] = [_number(x) for x in ep.toolset.turn_rewards[env_turn]]
                if span.start in starts:  # the prompt of a new sample: the template's render of the history
                    turn["sample"] = starts.index(span.start) + 2
            turns.append(turn)
        tokens = {"ids": ep.completion_ids, "text": tokenizer.batch_decode([[t] for t in ep.completion_ids]),
                  "model_mask": ep.model_mask, "sampler_logprob": ep.sampler_logprobs}
        for name, values in token_values.items():
            tokens[name] = None if values is None else values[i, :n].tolist()
        k = first_index + i
        records.append({
            "step": step, "mode": mode, "advantage_mode": advantage_mode,  # the viewer labels the credit by it
            "group": k // group_size, "sample": k % group_size,
            "policy_version": ep.policy_version, "question": row.get("question"), "answer": row.get("answer"),
            "answer_aliases": row.get("answer_aliases"),
            "prompt_text": tokenizer.decode(ep.prompt_ids), "turns": turns, "tokens": tokens,
            **({"prompt_images": images} if (images := [thumbnail(im) for im in conversation_images(
                getattr(ep, "prompt_messages", []))]) else {}),
            "rewards": {kind: {name: [_number(x) for x in v[i]] if isinstance(v[i], list) else _number(v[i])
                               for name, v in funcs.items()} for kind, funcs in rewards.items()},
            "R_T": episode_value(R_T, i, scored := turns_scored(R_T, i, ep.tool_turns)),
            "R_O": episode_value(R_O, i, scored), "A_T": episode_value(A_T, i, scored), "A_O": episode_value(A_O, i, scored),
            "first_result": ep.first_result, "stop_reason": ep.stop_reason,
            **({} if environment is None else {"environment": type(environment).__name__}),  # environments.py
            # without outputs: each is in its env turn's tool_calls, and the token text holds it again
            "tool_calls": [{"turn": c.turn, "name": c.name, "args": c.args, "ok": c.ok, "seconds": c.seconds}
                           for c in ep.calls],
        })
    return records


def rewards_by_name(scores, rows: slice, episodes: list, turn_funcs: list[Callable],
                    outcome_funcs: list[Callable]) -> dict[str, dict[str, list]]:
    """Each function's value per sample of `rows` (the trainer's Scores; `episodes`: those rows' episodes), as
    episode_records takes them: a number, or a list per tool turn for a per-turn function."""
    turn = {fn.__name__: [r[:ep.tool_turns + (ep.tool_turns < len(r) and not math.isnan(r[ep.tool_turns]))]
                           for r, ep in zip(scores.turn_per_func[rows, i].tolist(), episodes)]
            if is_per_tool_turn(fn) else scores.turn_per_func[rows, i, 0].tolist()
            for i, fn in enumerate(turn_funcs)}
    outcome = {fn.__name__: scores.outcome_per_func[rows, i].tolist() for i, fn in enumerate(outcome_funcs)}
    return {"turn": turn, "outcome": outcome}


def eval_metrics(results: list[dict], k: int) -> dict[str, float]:
    """`eval/...` metrics from one dict per episode (question row, the task's `metrics` (name -> bool),
    answered, tool_calls, tool_failures, rewards). With k episodes per question, pass@k is the share of
    questions with at least one exact match."""
    if not results:
        return {}
    mean = lambda values: sum(float(v) for v in values) / len(results)  # noqa: E731
    calls = sum(r["tool_calls"] for r in results)
    metrics = {f"eval/{name}": mean(r["metrics"][name] for r in results) for name in results[0]["metrics"]}
    metrics.update({
        "eval/answered_ratio": mean(r["answered"] for r in results),
        "eval/tool_calls_per_episode": mean(r["tool_calls"] for r in results),
        "eval/tool_success_rate": (1 - sum(r["tool_failures"] for r in results) / calls if calls
                                   else float("nan")),
        "eval/episodes": float(len(results)),
    })
    if k > 1 and "exact_match" in results[0]["metrics"]:
        solved: dict[int, bool] = {}
        for r in results:
            solved[r["question"]] = solved.get(r["question"], False) or r["metrics"]["exact_match"]
        metrics[f"eval/pass@{k}"] = sum(solved.values()) / len(solved)
    for name in results[0]["rewards"]:
        values = [r["rewards"][name] for r in results if not math.isnan(r["rewards"][name])]
        metrics[f"eval/rewards/{name}"] = sum(values) / len(values) if values else float("nan")
    return metrics


def eval_metric_names(k: int, turn_funcs: list[Callable], outcome_funcs: list[Callable],
                      task_metrics: list[str]) -> list[str]:
    """Every eval metric name (without `eval/`) that eval_metrics logs; `task_metrics`: the task's own
    (tasks.QA_EVAL_METRICS)."""
    names = [*task_metrics, "answered_ratio", "tool_calls_per_episode", "tool_success_rate", "episodes"] + \
        ([f"pass@{k}"] if k > 1 and "exact_match" in task_metrics else [])
    return names + [f"rewards/turn/{fn.__name__}" for fn in turn_funcs] + \
        [f"rewards/outcome/{fn.__name__}" for fn in outcome_funcs]


@dataclass
class RunArguments:
    """The recipe keys of the run's console, records and stopping; the trainer's config inherits them."""

    max_train_minutes: float | None = arg(None, "Wall-time budget: after the step that ends past it (the first "
                                          "evaluation included), evaluate, save a checkpoint and stop (None: no limit).")
    save_rollouts_steps: int = arg(0, "Record every N-th rollout and every evaluation under <output_dir>/rollouts "
                                   "for scripts/view_rollouts.py (0: off).", minimum=0)
    stop_timeout: float = arg(300.0, "Seconds from a SIGTERM to the end of the run: it stops at the next safe point "
                              "with a checkpoint; still running then, it exits (a second SIGTERM exits at once).")


class GracefulStop(TrainerCallback):
    """On SIGTERM (a preempted or cancelled job): stop at the next safe point, save a checkpoint, end the run.
    `--resume_from_checkpoint last` then continues at the same step with the same optimizer, scheduler and RNG
    state. Safe points: each step's end, where the flag is max-reduced across ranks (one scalar collective, so every
    rank stops at the same step even if only one got the signal); and, on one process, each round of a rollout and
    every wait on user code (base/runtime.STOP: StopRequested; the step in flight is dropped and the last finished one
    saved, its RNG state as it was when the dropped step began). `stop_timeout` bounds the rest: still running then,
    the process exits, as it does at once on a second SIGTERM. The signal's arrival is logged."""

    def __init__(self, trainer, stop_timeout: float = 300.0):
        self.trainer, self.stop_timeout = trainer, stop_timeout
        self.requested = False
        self.rng_at_step_begin = None
        STOP.clear()
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        if self.requested:  # the second: a scheduler's last word, or an impatient user
            os.write(2, b"A second SIGTERM: exiting now, without a checkpoint.\n")
            os._exit(128 + signum)
            return
        self.requested = True
        if self.trainer.accelerator.num_processes == 1:  # several: their rollouts are not in step; the step's end
            STOP.set()
        # logging takes locks the interrupted thread may hold: report and time the bound from a thread of its own
        threading.Thread(target=self._bounded, daemon=True, name="sigterm").start()

    def _bounded(self):
        logger.warning("SIGTERM received: stopping at the next safe point with a checkpoint, within stop_timeout=%gs "
                       "(a second SIGTERM exits at once).", self.stop_timeout)
        time.sleep(self.stop_timeout)
        logger.error("Still running %gs after SIGTERM (stop_timeout): exiting without a new checkpoint.",
                     self.stop_timeout)
        logging.shutdown()
        os._exit(128 + signal.SIGTERM)

    def on_step_begin(self, args, state, control, **kwargs):
        self.rng_at_step_begin = rng_states()

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor([float(self.requested)], device=self.trainer.accelerator.device)
        if self.trainer.accelerator.reduce(flag, reduction="max").item() > 0:
            logger.warning("SIGTERM: saving a checkpoint at step %d and stopping.", state.global_step)
            control.should_save = True
            control.should_training_stop = True


def rng_states() -> dict:
    """The RNG states a checkpoint saves (transformers' _save_rng_state), to put back before an interrupted step's
    checkpoint: the resumed run then draws what the uninterrupted one would have."""
    import random

    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state(),
            "cuda": torch.cuda.random.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if states["cuda"] is not None:
        torch.cuda.random.set_rng_state_all(states["cuda"])


def stoppable(trainer, train: Callable, *args, **kwargs):
    """`train(*args, **kwargs)`, then trainer_state.json in output_dir (the log history of every step, which
    scripts/plot_runs.py reads: TRL writes it only with a checkpoint, so a Python run with `save_strategy="no"` left
    none); on a StopRequested from a rollout, the checkpoint of the last finished step (its RNG state as that step
    left it), then the end of the run."""
    try:
        output = train(*args, **kwargs)
        trainer.save_state()
        return output
    except StopRequested:
        stop = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, GracefulStop))
        if stop.rng_at_step_begin is not None:
            set_rng_states(stop.rng_at_step_begin)
        step = trainer.state.global_step
        logger.warning("SIGTERM: the rollout of step %d stopped; saving a checkpoint at step %d and stopping.",
                       step + 1, step)
        if not os.path.isdir(os.path.join(trainer.args.output_dir, f"checkpoint-{step}")):
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        return None


class TimeBudget(TrainerCallback):
    """`max_train_minutes`: after the first optimizer step that ends past the budget (wall time from the
    start of training, the first evaluation included), evaluate there if evaluation is on, save a
    checkpoint and stop. Time-to-accuracy comparisons then have a measured point at the budget rather
    than at the last `eval_steps` before it. Rank 0's clock decides for every rank (a broadcast scalar),
    so all stop at the same step. A resumed run gets the whole budget again. `clock` (seconds) is what the
    budget reads: time.monotonic, or a test's own clock."""

    def __init__(self, trainer, minutes: float, clock=time.monotonic):
        self.trainer, self.seconds, self.clock, self.start = trainer, minutes * 60, clock, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        over = torch.tensor([float(self.clock() - self.start > self.seconds)], device=self.trainer.accelerator.device)
        if broadcast(over, from_process=0).item() > 0:
            logger.warning("max_train_minutes=%g reached: evaluating, saving a checkpoint at step %d and stopping.",
                           self.seconds / 60, state.global_step)
            control.should_evaluate = args.eval_strategy != "no"
            control.should_save = True
            control.should_training_stop = True


class StepPrinter(TrainerCallback):
    """One readable line per logged step (and per evaluation) on the main process, with the metrics a
    run is watched by. The full metrics go to `report_to` and trainer_state.json, not the console."""

    KEYS = [("loss", "loss"), ("rewards/turn/mean", "R_turn"), ("rewards/outcome/mean", "R_out"),
            ("rollout/tool_calls_per_episode", "calls/ep"), ("rollout/tool_success_rate", "tool_ok"),
            ("rollout/images_per_episode", "img/ep"),
            ("clip_ratio/region_mean", "clip"), ("completions/mean_length", "len"),
            ("rollout/seconds", "rollout_s")]
    # every task's eval logs eval/episodes; the keys a task lacks (a game has no exact match) are left out
    EVAL_KEYS = [("eval/exact_match", "exact_match"), ("eval/won", "won"), ("eval/first_search_hit", "search_hit"),
                 ("eval/tool_success_rate", "tool_ok"), ("eval/answered_ratio", "answered")]

    def on_train_begin(self, args, state, control, **kwargs):
        """A line before the first step's: that step's rollout and update take minutes on CPU, silent without it."""
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            episodes = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
            tqdm.write(f"Training {state.max_steps} steps from step {state.global_step}, {episodes} episodes a step "
                       f"({args.num_generations} per question); a line per step follows, each after its rollout and "
                       "update.")
            sys.stdout.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):
        from tqdm.auto import tqdm

        if not state.is_world_process_zero or not logs:
            return
        for first, keys, label in (("loss", self.KEYS, "step"), ("eval/episodes", self.EVAL_KEYS, "eval")):
            if first in logs:
                parts = [f"{short}={logs[k]:.3f}" for k, short in keys
                         if isinstance(logs.get(k), (int, float))]
                tqdm.write(f"{label} {state.global_step:>4} | " + " ".join(parts))  # above any progress bar
                sys.stdout.flush()


class StepBar(ProgressCallback):
    """TRL's step progress bar, without printing every metrics dict under it (StepPrinter prints a line), and
    only on a terminal (progress_bar). No evaluation bar: evaluation.py replaces the loop that would draw it."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = progress_bar(total=state.max_steps)
        self.current_step = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def install_console(trainer, max_train_minutes: float | None, stop_timeout: float = 300.0) -> None:
    """The trainer's callbacks beside TRL's: SIGTERM and the time budget stop a run cleanly, and the console gets
    StepPrinter's one line per step (and StepBar on a terminal), not transformers' dump of every metric."""
    from transformers.trainer_callback import PrinterCallback

    trainer.add_callback(StepPrinter())
    trainer.add_callback(GracefulStop(trainer, stop_timeout))
    if max_train_minutes is not None:
        trainer.add_callback(TimeBudget(trainer, max_train_minutes))
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(StepBar)


class TrainerReports:
    """The logging of MTGRPOEnvTrainer (a base class of it, kept here to keep the trainer file about the
    algorithm): TRL's metrics and completions table for each generation batch, and the recorded rollouts
    (`save_rollouts_steps`). `scores` and `adv` are the trainer's Scores and Advantages."""

    def _log(self, mode: str, prompts: list, episodes: list, scores, adv,
             seconds: float) -> None:
        self._log_rollout(mode, episodes, scores, adv, seconds)
        self._log_completions(prompts, episodes, scores, adv)

    def _log_rollout(self, mode: str, episodes: list, scores, adv,
                     seconds: float) -> None:
        m, G = self._metrics[mode], self._episodes_per_prompt(mode)
        for name, value in reward_metrics(scores, adv.informative.view(-1, G)[:, 0], self.turn_reward_funcs,
                                          self.outcome_reward_funcs).items():
            m[name].append(value)
        for kind, A in (("turn", adv.turn), ("outcome", adv.outcome)):
            groups = A.reshape(A.shape[0] // G, -1)  # (groups, G * K): rows are group-major
            m[f"rewards/{kind}/frac_zero_std_groups"].append((groups == 0).all(dim=1).float().mean().item())
        # one gather, never one per episode
        stats = gather(episode_stats(episodes).to(self.accelerator.device))
        for name, value in rollout_metrics(stats).items():
            m[name].append(value)
            warn_limit(self, name, value)
        m["rollout/seconds"].append(seconds)
        for name, value in agent_metrics(episodes, lambda rows: gather(rows.to(self.accelerator.device))).items():
            m[name].append(value)
        for name, value in self._judge_metrics().items():  # the LLM judge's calls, tokens, time (rewards/judge.py)
            m[name].append(value)
        staleness = torch.tensor([float(self.state.global_step - ep.policy_version) for ep in episodes],
                                 device=self.accelerator.device)
        m["rollout/staleness"].append(gather(staleness).mean().item())
        if self.backend.external:
            m["rollout/aborted_requests"].append(float(self.backend.aborted_requests))  # cumulative
        tools = bool(self.env.tools) or self.env.environments is not None
        for name, value in trl_metrics(stats, per_sample_rewards(scores), torch.cat([self.turn_weights,
                                       self.outcome_weights]), self.reward_func_names, G, self.args.scale_rewards,
                                       tools).items():  # TRL's names, beside ours
            m[name].append(value)
        if mode == "train":  # TRL's num_tokens: prompt tokens and model-sampled ones (tool_mask 1), since the start
            column = lambda name: int(stats[:, EPISODE_STATS.index(name)].sum())  # noqa: E731
            self.state.num_input_tokens_seen += column("prompt_tokens") + column("model_tokens")
            # ours: every completion token the trainer forwards (the model's, the environment's, re-rendered prompts)
            self._completion_tokens_seen = getattr(self, "_completion_tokens_seen", 0) + column("model_tokens") \
                + column("env_tokens")
        m["num_tokens"] = [self.state.num_input_tokens_seen]
        m["rollout/completion_tokens_seen"] = [float(getattr(self, "_completion_tokens_seen", 0))]

    def _log_sampler_gap(self, mode: str, weights: torch.Tensor, mask: torch.Tensor, trainer_logps: torch.Tensor,
                         sampler_logps: torch.Tensor, listed: torch.Tensor | None, token_turns: torch.Tensor) -> None:
        """The importance weights' mean and the trainer-vs-sampler logprob gap, first turn and later turns."""
        m = self._metrics[mode]
        m["sampling/importance_weight_mean"].append(self._masked_mean(weights, mask))
        if listed is not None:  # the share of tokens scored against the sampler's own kept set (completions.py)
            m["sampling/kept_set_listed"].append(self._masked_mean(listed, mask))
        gap = torch.nan_to_num((trainer_logps - sampler_logps).abs(), nan=0.0)
        first = (token_turns == 0).long()
        m["sampling/logprob_diff_first_turn"].append(self._masked_mean(gap, mask * first))
        m["sampling/logprob_diff_later_turns"].append(self._masked_mean(gap, mask * (1 - first)))
        # TRL's names of the same (over every model token; 0 where there is none)
        m["sampling/sampling_logp_difference/mean"].append(self._masked_mean(gap, mask))
        m["sampling/importance_sampling_ratio/mean"].append(m["sampling/importance_weight_mean"][-1])
        for name, x, pick, none in (("sampling_logp_difference/max", gap, torch.amax, -math.inf),
                                    ("importance_sampling_ratio/min", weights, torch.amin, math.inf),
                                    ("importance_sampling_ratio/max", weights, torch.amax, -math.inf)):
            on = x[mask.bool()]
            local = pick(on) if on.numel() else x.new_tensor(none)  # a process without model tokens: no say
            value = pick(gather(local.view(1))).item()
            m[f"sampling/{name}"].append(value if math.isfinite(value) else 0.0)

    def _masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1)).item()

    def _judge_metrics(self) -> dict[str, float]:
        """`judge/...` (calls, tokens, seconds, cache hits, parse failures) since the last call: the LLM judge's
        work for this batch's rewards, when a reward is a judge (rewards/judge.py); else {}."""
        return judge_metrics(self.turn_reward_funcs + self.outcome_reward_funcs)

    def log_dynamic_sampling(self, passes: list) -> None:
        """`dynamic_sampling/...` of one generation batch (dynamic_sampling.resample_groups calls it). `passes`: one
        (Scores, (groups,) signal, groups rolled out) per scoring pass: the first rolled out every group (the policy's
        own draw), each later one the groups replaced after the pass before. `rewards/...` describe the batch trained
        on, after replacement; `first_draw/` the first pass (what the policy scored on the questions it was given),
        and `replacements/` the replaced groups of the later passes (NaN when there were none)."""
        m, G = self._metrics["train"], self.num_generations
        m["dynamic_sampling/rounds"].append(float(len(passes) - 1))  # rounds that rolled out replacements
        m["dynamic_sampling/groups_replaced"].append(float(sum(len(groups) for _, _, groups in passes[1:])))
        m["dynamic_sampling/groups_with_signal"].append(passes[-1][1].float().mean().item())
        none = [(passes[0][0], passes[0][1], [])]  # a pass that picks no group: no replacements stack to no rows
        for name, picked in (("first_draw", passes[:1]), ("replacements", none + passes[1:])):
            scores, signal = rolled_out_rows(picked, G)
            for key, value in reward_metrics(scores, signal, self.turn_reward_funcs, self.outcome_reward_funcs,
                                             prefix=f"dynamic_sampling/{name}/").items():
                m[key].append(value)

    def _log_completions(self, prompts: list, episodes: list, scores,
                         adv) -> None:
        """TRL's completions table (`log_completions`): prompts, canonical completions, rewards, A_O."""
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object([ep.messages for ep in episodes]))
        per_func = per_sample_rewards(scores)  # (B, F)
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(per_func[:, i].tolist())
        self._logs["advantages"].extend(adv.outcome.tolist())
        # what rewards logged through TRL's `log_extra` and `log_metric`, as TRL flushes it (sorted: every rank
        # gathers the same names in the same order)
        extra, logged = self.take_reward_logs()
        for column in sorted(set(gather_object(list(extra)))):
            values = extra.get(column, [None] * len(prompts))
            self._logs["extra"][column].extend(gather_object(values))
        for name in sorted(set(gather_object(list(logged)))):
            values = logged.get(name, [])
            total, count = gather(torch.tensor([[sum(values), len(values)]], dtype=torch.float32,
                                               device=self.accelerator.device)).sum(dim=0).tolist()
            self._metrics["train" if self.model.training else "eval"][name].append(total / max(count, 1))

    def take_reward_logs(self) -> tuple[dict[str, list], dict[str, list[float]]]:
        """(columns, metrics): what the rewards logged on this process through TRL's keywords since the last call,
        `log_extra(column, values)` and `log_metric(name, value)` (a list of values per name); TRL's buffers are
        emptied."""
        extra, logged = dict(self._pending_extra_logs), dict(self._pending_metrics)
        self._pending_extra_logs.clear()
        self._pending_metrics.clear()
        return extra, logged

    # -- recorded rollouts (scripts/view_rollouts.py reads them) ---------------------------------------
    def _record_rollout(self, inputs: list[dict], episodes: list, scores, adv,
                        batch: dict, weights: torch.Tensor | None) -> None:
        every = self.args.save_rollouts_steps
        self._rollouts += 1
        if not every or (self._rollouts - 1) % every:
            return
        B, rank = len(episodes), self.accelerator.process_index
        local = slice(rank * B, (rank + 1) * B)
        records = episode_records(
            self.env.tokenizer, episodes, inputs, step=self.state.global_step + 1, mode="train",
            first_index=rank * B, group_size=self.num_generations,
            rewards=rewards_by_name(scores, local, episodes, self.turn_reward_funcs, self.outcome_reward_funcs),
            R_T=scores.R_T[local], R_O=scores.R_O[local],
            A_T=adv.turn[local], A_O=adv.outcome[local], advantage_mode=self.advantage_mode,
            token_values={"advantage": adv.tokens,  # before the importance weight (is_weight)
                          "trainer_logprob": batch.get("old_per_token_logps"),
                          "is_weight": weights},
        )
        self.write_records(f"step-{self.state.global_step + 1:06d}.jsonl", records)

    def write_records(self, name: str, records: list[dict], folder: str | None = None) -> str:
        """Gather every process's records; the main process writes them as JSONL, as `name` in `folder` (default:
        the run's rollouts/, which scripts/view_rollouts.py reads). Returns the path."""
        records = gather_object(records) if self.accelerator.num_processes > 1 else records
        path = os.path.join(folder or os.path.join(self.args.output_dir, "rollouts"), name)
        if self.accelerator.is_main_process:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                for record in records:
                    f.write(json.dumps(record, default=json_image) + "\n")  # a tool output's image: a thumbnail
        return path


# What save_model writes, by transformers' names: safetensors (one file or shards), a PEFT adapter, or torch's pickle.
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model.bin")
# the repository's viewer (mt_grpo/run/ is two floors below the repository root)
VIEWER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "view_rollouts.py")


def closing_lines(trainer) -> list[str]:
    """What a finished run left and how to look at it: the output folder, the saved model, the recorded
    rollouts (`save_rollouts_steps`) and the viewer's command (paths as given, the viewer's from the cwd)."""
    out = trainer.args.output_dir
    saved = any(os.path.isfile(os.path.join(out, name)) for name in MODEL_FILES)
    lines = [f"Run finished. Output folder: {out}",
             f"  model: {out} (load it with --model_name_or_path {shlex.quote(out)})" if saved
             else f"  model: not saved (no weights in {out})"]
    rollouts = os.path.join(out, "rollouts")
    if trainer.args.save_rollouts_steps and os.path.isdir(rollouts):
        names = os.listdir(rollouts)
        train, evals = (sum(n.startswith(prefix) and n.endswith(".jsonl") for n in names)
                        for prefix in ("step-", "eval-step-"))
        lines += [f"  rollouts: {rollouts} (training steps: {train}, evaluations: {evals})",
                  f"  view them: python {shlex.quote(os.path.relpath(VIEWER))} {shlex.quote(out)}"
                  f"  # writes {os.path.join(out, 'rollouts.html')}"]
    return lines


def report_outputs(trainer) -> None:
    """closing_lines on the console, from the main process only."""
    if trainer.accelerator.is_main_process:
        print("\n".join(closing_lines(trainer)), flush=True)


def end_processes(trainer) -> None:
    """Wait for every rank, then destroy the process group. Without it, a rank that reaches interpreter
    shutdown while gloo's worker threads still hold tensors dies with SIGABRT ("terminate called without
    an active exception") after a run that succeeded, and the launcher reports the whole job failed. Even with it, a
    loaded machine saw that abort once (ZeRO-3 on 2 CPU processes, a C++ thread torn down at exit): so a rank of a
    run on several processes, its work saved, runs the exit handlers, flushes its logs and leaves without the
    interpreter's teardown."""
    trainer.accelerator.wait_for_everyone()
    several = trainer.accelerator.num_processes > 1
    trainer.accelerator.end_training()
    if several:
        import atexit

        atexit._run_exitfuncs()  # what a normal exit runs (MCP servers closed, ...), in its order
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
