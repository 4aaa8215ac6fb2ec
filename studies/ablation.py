"""Issue 22's ablation: what each lever buys MT-GRPO on the learning study's task, one seed each.

Every lever is the study recipe (hf_recipes/SmolLM2-135M-Instruct/study.yaml, `advantage_mode: mt_grpo`)
plus the few flags in LEVERS, run one at a time with the same wall-clock budget (`--budget` minutes,
evaluations included; the trainer's `max_train_minutes`): a run still going then finishes its step,
is evaluated there, saves a checkpoint and stops, so a lever that makes steps dearer shows it as fewer
steps. (The first five levers' runs in studies/data/ablation_runs were stopped by SIGTERM at the budget, before
this: their last evaluation is the last multiple of 10 steps they reached.) Compare levers at the same evaluation step (what
the lever does to learning) and at the budget (what it buys per minute).

    .venv/bin/python studies/ablation.py --levers dynamic_sampling lr_5e-5       # 45 min each
    .venv/bin/python studies/ablation.py --levers baseline dynamic_sampling \\
        --reuse baseline=studies/data/learning_study_runs/mt_grpo-s1 --out studies/data/ablation     # a table from runs made before

Runs go to RUNS/<lever>-s<seed>/; a run that finished or stopped at its budget is reused (--fresh redoes
it). `--reuse NAME=DIR` takes a lever's run from elsewhere (the study's seed-1 MT-GRPO run is the
baseline: it is reproduced exactly by a rerun). Prints the table and writes OUT.csv: one row per lever
and evaluation, with the columns of the learning study's CSV plus the lever's training statistics.
"""

import argparse
import math
import os
import shutil
import sys

from common import print_table, write_rows_csv
from learning_study import METRICS, budget_flags, command, finished, run_all, stopped_early, training_minutes

from plot_runs import load_log_history

# name -> (flags added to the study recipe, why it might help)
LEVERS = {
    "baseline": ([], "the study recipe: 1 question x 8 episodes per step, lr 2e-5, 30 steps"),
    "dynamic_sampling": (["--dynamic_sampling", "true"],
                         "a group whose advantages are all 0 is replaced by a new question's group (DAPO)"),
    "lr_5e-5": (["--learning_rate", "5e-5"], "2.5x the learning rate: the rare exact answers move the policy more"),
    "num_iterations_2": (["--num_iterations", "2"], "each rollout serves 2 optimizer steps: half the rollouts per step"),
    "two_questions": (["--gradient_accumulation_steps", "2"],  # the recipe's micro-batch is one group of 8
                      "2 questions x 8 episodes per step: twice the chances of an exact answer per update"),
    "grounded_answer": (["--outcome_reward_funcs", "exact_match_reward_func", "exist_answer_reward_func",
                         "grounded_answer_reward_func", "format_reward_func"],
                        "0.25 for an answer copied from the result: a signal for copying in every group, "
                        "not only the rare one with an exact answer"),
}
LEVERS["one_document"] = (["--tools", "mt_grpo.tools.search:make_search_top1_tool"],
                          "`search` returns one document unless asked for more: the model copied the next "
                          "document's facts (docs/results.md)")
# the two levers that helped alone in seed 1 (docs/results.md), together: the copy signal, at half the rollouts
LEVERS["grounded_ni2"] = (LEVERS["grounded_answer"][0] + LEVERS["num_iterations_2"][0],
                          "grounded_answer and num_iterations_2 together")
# the two levers aimed at the copying step, together: one document to copy from, and a reward for copying a
# span of it that is not in the question (the one_document model wrote the right fact in its reasoning and
# answered with the question's own entity: docs/results.md)
LEVERS["grounded_one_doc"] = (LEVERS["grounded_answer"][0] + LEVERS["one_document"][0],
                              "grounded_answer and one_document together")


def lever_command(lever: str, seed: int, path: str, flags: list[str]) -> list[str]:
    return command("mt_grpo", seed, path, LEVERS[lever][0] + flags)


def lever_stats(history: list[dict]) -> dict:
    """What the training log says about one run: steps, time, signal, exact answers in training."""
    train = [h for h in history if "loss" in h and "step" in h]
    step_times = [h["step_time"] for h in train if "step_time" in h]
    last = max((h["step"] for h in train), default=0)
    mean = lambda key: (sum(v) / len(v) if (v := [h[key] for h in train if key in h]) else math.nan)  # noqa: E731
    # dynamic sampling: what the policy scored on its own draws, not the batch after replacement (0 signal-free
    # groups by construction); runs logged before `dynamic_sampling/first_draw/` give the trained batch's
    drawn = "dynamic_sampling/first_draw/" if any("dynamic_sampling/first_draw/rewards/outcome/mean" in h
                                                  for h in train) else ""
    return {"steps": last, "minutes": training_minutes(history, last),
            "seconds_per_step": sum(step_times) / len(step_times) if step_times else math.nan,
            # with one group per step, the share of steps whose group had no signal
            "zero_signal_share": mean(drawn + "rewards/frac_zero_signal_groups"),
            "train_exact_match": mean(drawn + "rewards/outcome/exact_match_reward_func"),
            "groups_replaced": sum(h.get("dynamic_sampling/groups_replaced", 0.0) for h in train)}


def rows_of(lever: str, seed: int, path: str) -> list[dict]:
    """One row per evaluation of the run, each with the run's training statistics."""
    history = load_log_history(path)
    stats = lever_stats(history)
    evals = sorted({h["step"] for h in history if "eval/exact_match" in h})
    return [{"lever": lever, "seed": seed, "step": step, "minutes": training_minutes(history, step),
             **{m: next(h for h in history if h.get("step") == step and "eval/exact_match" in h).get(m, math.nan)
                for m in METRICS},
             **{f"run/{k}": v for k, v in stats.items()}} for step in evals]


def table(rows: list[dict]) -> list[list]:
    out = []
    for lever in dict.fromkeys(r["lever"] for r in rows):
        runs = [r for r in rows if r["lever"] == lever]
        at = {r["step"]: r for r in runs}
        cell = lambda m: " / ".join(f"{at[s][m]:.3f}" for s in sorted(at))  # noqa: E731
        s = runs[-1]
        out.append([lever, " ".join(LEVERS.get(lever, ([], ""))[0]) or "-", s["run/steps"], f"{s['run/minutes']:.1f}",
                    f"{s['run/seconds_per_step']:.0f}", "/".join(str(k) for k in sorted(at)), cell("eval/exact_match"),
                    cell("eval/first_search_hit"), f"{s['run/zero_signal_share']:.2f}",
                    f"{s['run/train_exact_match']:.3f}", int(s["run/groups_replaced"])])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=float, default=45.0, help="minutes of wall time per run, evaluations "
                    "included (the trainer's max_train_minutes: it evaluates where it stops)")
    ap.add_argument("--runs", default="outputs/ablation", help="folder of the runs")
    ap.add_argument("--out", default="outputs/ablation/ablation", help="OUT.csv")
    ap.add_argument("--fresh", action="store_true", help="redo runs that already finished or stopped at the budget")
    ap.add_argument("--reuse", nargs="*", default=[], metavar="NAME=DIR",
                    help="take a lever's run from DIR instead of running it (its trainer_state.json)")
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    reused = dict(item.split("=", 1) for item in args.reuse)
    if unknown := [name for name in reused if name not in args.levers]:
        raise SystemExit(f"--reuse names {unknown}, which are not among --levers {args.levers}.")
    rows, failed = [], []
    for lever in args.levers:
        path = reused.get(lever) or os.path.join(args.runs, f"{lever}-s{args.seed}")
        if lever not in reused and (args.fresh or not (finished(path) or stopped_early(path))):
            shutil.rmtree(path, ignore_errors=True)
            failed += run_all([(lever, args.seed, path)], flags + budget_flags(args.budget), 1, None,
                              command_fn=lever_command)
        if path not in failed:
            rows += rows_of(lever, args.seed, path)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_rows_csv(rows, args.out + ".csv")
    print_table(f"MT-GRPO, seed {args.seed}, {args.budget:.0f} min per run: evaluations on the test split at the steps "
                "given; training statistics over the run's steps",
                ["lever", "flags", "steps", "min of steps", "s/step", "eval steps", "exact match", "first-search hit",
                 "zero-signal steps", "train exact", "groups replaced"], table(rows))
    print(f"\nwrote {args.out}.csv")
    if failed:
        raise SystemExit(f"{len(failed)} runs failed (left out above); their logs: {[f + '/log.txt' for f in failed]}")


if __name__ == "__main__":
    main()
