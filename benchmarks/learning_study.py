"""The learning study: does turn-level credit help? MT-GRPO against GRPO-OR (`outcome_only`) and
GRPO-MR (`merged`), and the per-turn mode, on the same model, data, seeds, step budget and
hyperparameters (hf_recipes/SmolLM2-135M-Instruct/study.yaml), each evaluated on the fictional
knowledge base's held-out test split before the first step and every `eval_steps`.

    .venv/bin/python benchmarks/learning_study.py                   # the CPU study in docs/results.md
    .venv/bin/python benchmarks/learning_study.py --modes mt_grpo outcome_only --seeds 1
    python benchmarks/learning_study.py --modes mt_grpo outcome_only --seeds 2 --runs outputs/study_gpu \
        --out docs/learning_study_gpu -- --use_cpu false --bf16 true --max_steps 60 --eval_max_samples 95

Flags after `--` go to every run (any recipe field). `--recipe` studies another task, e.g. the TextWorld game
(hf_recipes/SmolLM2-135M-Instruct/textworld_quest.yaml) with `--metrics eval/won ...`; its per_turn mode keeps the
recipe's turn rewards (the knowledge base's per-turn functions are for study.yaml). Runs go to outputs/study/<mode>-s<seed>/ and
run `--parallel` at a time (default 1; a CPU study run peaks at about 3.3 GiB, so two fit on a
24 GiB machine, sharing its cores; on an H100 a run once held 61-69 GiB, so four ran out of memory).
A run that already finished is reused (delete its folder, or pass --fresh, to redo it), and a run
stopped by --deadline resumes from the checkpoint it saved. `--budget MIN` gives every run the same wall
time (time to accuracy, issue 22) through the trainer's `max_train_minutes`: a run evaluates at the step
that passes it, saves and stops, and is then done, not resumed. Writes OUT.csv (one row per
run and evaluation, with the minutes the run had trained by then), OUT.png (eval exact match, tool
success, first-search hit and tool calls per episode against step, and exact match and first-search hit
against minutes of training: a line per mode, the mean over seeds, with a band from the lowest to the
highest seed) and prints the table of the first and last evaluation per mode. `--compare docs/learning_study.csv` then prints, evaluation by evaluation, how far this
study lands from the committed one (the reproducibility check).
"""

import argparse
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from common import ROOT, print_table

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from plot_runs import load_log_history  # noqa: E402

RECIPE = os.path.join(ROOT, "hf_recipes", "SmolLM2-135M-Instruct", "study.yaml")
MODE_FLAGS = {
    "mt_grpo": [],
    "outcome_only": [],
    "merged": [],
    "per_turn": ["--turn_reward_funcs", "tool_execution_per_turn", "answer_in_result_per_turn",
                 "repeated_query_penalty_per_turn"],
}
METRICS = ["eval/exact_match", "eval/tool_success_rate", "eval/first_search_hit", "eval/answered_ratio",
           "eval/tool_calls_per_episode"]


def run_dir(out_root: str, mode: str, seed: int) -> str:
    return os.path.join(out_root, f"{mode}-s{seed}")


def finished(path: str) -> bool:
    """Whether the run trained all its steps (a run stopped by --deadline saved its state and a checkpoint
    at an earlier step: it resumes from that checkpoint when the study is run again)."""
    state = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state):
        return False
    with open(state) as f:
        state = json.load(f)
    return state["global_step"] >= state["max_steps"]


def stopped_early(path: str) -> bool:
    return any(name.startswith("checkpoint-") for name in os.listdir(path)) if os.path.isdir(path) else False


def budget_flags(minutes: float | None) -> list[str]:
    """The trainer's own time budget (`max_train_minutes`): it evaluates at the step that passes it, saves
    and stops, so every run gets the same wall time and a measured point at its end."""
    return [] if minutes is None else ["--max_train_minutes", f"{minutes:g}"]


def done(path: str, budgeted: bool) -> bool:
    """Whether a run needs no more training: it finished, or, under a per-run budget, it stopped at it."""
    return finished(path) or (budgeted and stopped_early(path))


def command(mode: str, seed: int, path: str, flags: list[str], recipe: str = RECIPE) -> list[str]:
    """The trainer command of one run; a run stopped early resumes from its last checkpoint."""
    mode_flags = MODE_FLAGS[mode] if recipe == RECIPE else []
    return [sys.executable, os.path.join(ROOT, "mt_grpo_trainer.py"), "--config", recipe, "--advantage_mode", mode,
            "--seed", str(seed), "--output_dir", path, *mode_flags, *flags,
            *(["--resume_from_checkpoint", "last"] if stopped_early(path) else [])]


def launch(mode: str, seed: int, path: str, flags: list[str], threads: int,
           command_fn: Callable = command) -> subprocess.Popen:
    cmd = command_fn(mode, seed, path, flags)
    resume = "--resume_from_checkpoint" in cmd  # then the log goes on where the stopped run's ended
    os.makedirs(path, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log = open(os.path.join(path, "log.txt"), "a" if resume else "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_all(jobs: list[tuple[str, int, str]], flags: list[str], parallel: int, deadline: float | None,
            stagger: float = 0.0, command_fn: Callable = command) -> list[str]:
    """Keep `parallel` runs going; the machine's cores are split between them (OpenMP threads that
    outnumber the cores spin and slow everything down). At `deadline` (seconds from now) the runs in
    flight get SIGTERM: each finishes its step, saves its state and stops; no new run starts. Starts
    are `stagger` seconds apart (GPU contexts created at once can fail). `command_fn(mode, seed, path, flags)`
    makes a run's command (benchmarks/peer_trl.py runs its own workers). Returns the failed runs."""
    threads = max(1, (os.cpu_count() or 1) // parallel)
    pending, running, failed = list(jobs), [], []
    stop_at = time.monotonic() + deadline if deadline else math.inf
    while pending or running:
        if time.monotonic() > stop_at:
            pending = []
            for *_, proc in running:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            stop_at = math.inf
        while pending and len(running) < parallel:
            mode, seed, path = pending.pop(0)
            print(f"start {mode} seed {seed} -> {path}", flush=True)
            running.append((mode, seed, path, time.monotonic(), launch(mode, seed, path, flags, threads, command_fn)))
            time.sleep(stagger)
        time.sleep(5)
        for job in [j for j in running if j[4].poll() is not None]:
            mode, seed, path, start, proc = job
            running.remove(job)
            status = "done" if proc.returncode == 0 else f"FAILED ({proc.returncode}), see {path}/log.txt"
            print(f"{status}: {mode} seed {seed} in {(time.monotonic() - start) / 60:.1f} min", flush=True)
            if proc.returncode != 0:
                failed.append(path)
    return failed


def training_minutes(history: list[dict], step: int) -> float:
    """Minutes the run trained up to `step`: the sum of TRL's `step_time` (each optimizer step's rollout,
    forward and backward; the optimizer update, ~1 s here, and evaluation are not in it). NaN without it."""
    seconds = {h["step"]: h["step_time"] for h in history if "step_time" in h}
    return sum(v for k, v in seconds.items() if k <= step) / 60 if seconds else float("nan")


def collect(jobs: list[tuple[str, int, str]], metrics: list[str] = METRICS) -> list[dict]:
    """One row per run and evaluation (an evaluation: a log entry with the first metric)."""
    rows = []
    for mode, seed, path in jobs:
        history = load_log_history(path)
        for step in sorted({h["step"] for h in history if metrics[0] in h}):
            entry = next(h for h in history if h.get("step") == step and metrics[0] in h)
            rows.append({"mode": mode, "seed": seed, "step": step, "minutes": training_minutes(history, step),
                         **{m: entry.get(m, float("nan")) for m in metrics}})
    return rows


def write_csv(rows: list[dict], path: str, metrics: list[str] = METRICS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mode", "seed", "step", "minutes", *metrics])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})


def curve(rows: list[dict], mode: str, metric: str) -> list[tuple[float, float, list[float]]]:
    """A mode's points for one metric, as (step, minutes, values over seeds): each step that every seed
    evaluated, then, when the seeds stopped at different steps (a time budget stops each where its own
    steps run out), one point for where they stopped: each seed's last evaluation, at the mean of their
    steps and of their minutes. A mean over only the seeds that reached a step would show one seed's
    value as the mode's. Minutes are the mean over seeds (NaN for runs from before the time axis);
    NaN values (no tool call, so no success rate) are left out, and a point with none is dropped."""
    runs: dict[int, dict[int, dict]] = {}
    for row in rows:
        if row["mode"] == mode:
            runs.setdefault(row["seed"], {})[row["step"]] = row
    if not runs:
        return []
    shared = sorted(set.intersection(*(set(run) for run in runs.values())))
    groups = [(float(step), [run[step] for run in runs.values()]) for step in shared]
    lasts = [run[max(run)] for run in runs.values()]
    if not shared or any(row["step"] != shared[-1] for row in lasts):
        groups.append((sum(row["step"] for row in lasts) / len(lasts), lasts))
    points = []
    for step, group in groups:
        minutes = [row["minutes"] for row in group if not math.isnan(row["minutes"])]
        values = [row[metric] for row in group if not math.isnan(row[metric])]
        if values:
            points.append((step, sum(minutes) / len(minutes) if minutes else math.nan, values))
    return points


def plot(rows: list[dict], path: str, title: str, metrics: list[str] = METRICS):
    from matplotlib.figure import Figure

    # tool_success_rate is undefined (left out) at an eval with no tool call: calls per episode and
    # first_search_hit show what the policy does there
    fig = Figure(figsize=(11, 12))
    shown = ([m for m in metrics if m != "eval/answered_ratio"] + ["eval/answered_ratio"])[:4]
    panels = [(m, "step") for m in shown] + [(shown[0], "minutes"), (shown[2], "minutes")]
    for ax, (metric, x_axis) in zip(fig.subplots(3, 2).flat, panels):
        data = {mode: curve(rows, mode, metric) for mode in dict.fromkeys(r["mode"] for r in rows)}
        for mode, points in data.items():
            if not points:
                continue
            at = [p[0] if x_axis == "step" else p[1] for p in points]
            if all(math.isnan(a) for a in at):  # runs from before the time axis: no minutes to place them at
                continue
            line, = ax.plot(at, [sum(p[2]) / len(p[2]) for p in points], marker="o", label=mode)
            ax.fill_between(at, [min(p[2]) for p in points], [max(p[2]) for p in points], color=line.get_color(),
                            alpha=0.18, linewidth=0)
        ax.set_title(metric + ("" if x_axis == "step" else " against time"))
        ax.set_xlabel("optimizer step" if x_axis == "step" else "minutes of training steps (evaluation excluded)")
        # rates fit [0, 1]; calls per episode may exceed 1
        top = max([1.0, *(v for points in data.values() for p in points for v in p[2])])
        ax.set_ylim(-0.02, top + 0.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def summary(rows: list[dict], metrics: list[str] = METRICS) -> None:
    table = []
    cell = lambda v: f"{sum(v) / len(v):.3f} ({min(v):.3f}-{max(v):.3f})"  # noqa: E731
    stops_of = {mode: [max(r["step"] for r in rows if (r["mode"], r["seed"]) == (mode, seed))  # each seed's last step
                       for seed in dict.fromkeys(r["seed"] for r in rows if r["mode"] == mode)]
                for mode in dict.fromkeys(r["mode"] for r in rows)}
    for metric in metrics:
        for mode, stops in stops_of.items():
            points = {step: (minutes, values) for step, minutes, values in curve(rows, mode, metric)}
            start, end = points.get(0.0), points.get(sum(stops) / len(stops))
            table.append([metric, mode, cell(start[1]) if start else "n/a",
                          f"step {'/'.join(map(str, stops))}, " + (f"{end[0]:.1f} min: {cell(end[1])}" if end else "n/a")])
    print_table("Evaluation on the test split: mean over seeds (lowest-highest) at step 0 and at each seed's last "
                "evaluation; tool success over seeds that made a call, n/a if none did",
                ["metric", "mode", "step 0", "last (each seed's step; minutes of training: mean over seeds)"], table)


def read_csv(path: str) -> list[dict]:
    """Rows as `collect` makes them, from a CSV that `write_csv` wrote."""
    with open(path, newline="") as f:
        return [{"mode": r["mode"], "seed": int(r["seed"]), "step": int(r["step"]),
                 "minutes": float(r.get("minutes") or "nan"),  # CSVs before the time axis have none
                 **{m: float(r[m]) for m in METRICS}} for r in csv.DictReader(f)]


def with_earlier_runs(rows: list[dict], earlier: list[dict]) -> list[dict]:
    """`earlier`'s rows of the runs (mode, seed) that `rows` does not have, then `rows`."""
    ran = {(r["mode"], r["seed"]) for r in rows}
    return [r for r in earlier if (r["mode"], r["seed"]) not in ran] + rows


def csv_difference(new: float, old: float) -> float:
    """|new - old| with `new` rounded as the CSV writes it; NaN (no tool call, so no success rate)
    matches only NaN."""
    new = float(f"{new:.4f}")
    if math.isnan(new) or math.isnan(old):
        return 0.0 if math.isnan(new) and math.isnan(old) else math.inf
    return abs(new - old)


def compare(rows: list[dict], reference: str) -> tuple[int, list[list]]:
    """How far this study's evaluations are from an earlier CSV's, row by row (same mode, seed and
    step): the check that the study reproduces. Returns the number of rows without a counterpart and
    one row per metric: [metric, evaluations compared, identical, largest difference]."""
    ref = {(r["mode"], r["seed"], r["step"]): r for r in read_csv(reference)}
    pairs = [(row, ref[key]) for row in rows if (key := (row["mode"], row["seed"], row["step"])) in ref]
    table = []
    for metric in METRICS:
        diffs = [csv_difference(row[metric], old[metric]) for row, old in pairs]
        table.append([metric, len(diffs), sum(d == 0 for d in diffs), max(diffs, default=0.0)])
    return len(rows) - len(pairs), table


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["mt_grpo", "outcome_only", "merged"], choices=sorted(MODE_FLAGS))
    ap.add_argument("--recipe", default=RECIPE, help="the recipe every run trains (default: study.yaml)")
    ap.add_argument("--metrics", nargs="+", default=METRICS, help="eval metrics to collect, plot and tabulate; the "
                    "first marks an evaluation (default: the knowledge base's)")
    ap.add_argument("--title", default="SmolLM2-135M-Instruct on the fictional KB", help="the plot's title")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at a time (a CPU study run peaks at about 3.3 GiB; runs share the cores)")
    ap.add_argument("--runs", default=os.path.join(ROOT, "outputs", "study"), help="folder of the runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "learning_study"), help="OUT.csv and OUT.png")
    ap.add_argument("--fresh", action="store_true", help="redo runs that already finished")
    ap.add_argument("--deadline", type=float, help="seconds; then running runs stop after their step (SIGTERM)")
    ap.add_argument("--budget", type=float, help="minutes of wall time per run (max_train_minutes): the run then "
                    "evaluates, saves and stops after its step, and counts as done (it is not resumed)")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between run starts")
    ap.add_argument("--compare", metavar="CSV", help="an earlier study's CSV: print the differences, row by row")
    ap.add_argument("--include", metavar="CSV", help="an earlier study's CSV: its runs (mode and seed) that are not "
                    "in this study are kept in OUT.csv, the plot and the table (to add a mode without rerunning the rest)")
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    jobs = [(mode, seed, run_dir(args.runs, mode, seed)) for seed in args.seeds for mode in args.modes]
    budgeted = args.budget is not None
    todo = [j for j in jobs if args.fresh or not done(j[2], budgeted)]
    if args.fresh:
        for _, _, path in todo:
            shutil.rmtree(path, ignore_errors=True)
    start = time.monotonic()
    failed = run_all(todo, flags + budget_flags(args.budget), args.parallel, args.deadline, args.stagger,
                     command_fn=lambda *a: command(*a, recipe=args.recipe))
    rows = collect([j for j in jobs if done(j[2], budgeted) and j[2] not in failed], args.metrics)
    if args.include:
        rows = with_earlier_runs(rows, read_csv(args.include))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_csv(rows, args.out + ".csv", args.metrics)
    seeds = {m: len({r["seed"] for r in rows if r["mode"] == m}) for m in dict.fromkeys(r["mode"] for r in rows)}
    plot(rows, args.out + ".png", f"{args.title}, seeds per mode: " + ", ".join(f"{m} {n}" for m, n in seeds.items()),
         args.metrics)
    summary(rows, args.metrics)
    if args.compare:
        unmatched, table = compare(rows, args.compare)
        print_table(f"Against {args.compare}, evaluation by evaluation ({unmatched} without a counterpart there)",
                    ["metric", "compared", "identical", "largest difference"], table)
    print(f"\n{len(todo)} runs in {(time.monotonic() - start) / 60:.1f} min; wrote {args.out}.csv and {args.out}.png")
    if failed:
        raise SystemExit(f"{len(failed)} runs failed (left out above); their logs: {[f + '/log.txt' for f in failed]}")


if __name__ == "__main__":
    main()
