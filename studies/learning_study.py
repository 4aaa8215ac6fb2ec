"""The learning study: does turn-level credit help? MT-GRPO against GRPO-OR (`outcome_only`) and
GRPO-MR (`merged`), and the per-turn mode, on the same model, data, seeds, step budget and
hyperparameters (hf_recipes/SmolLM2-135M-Instruct/study.yaml), each evaluated on the fictional
knowledge base's held-out test split before the first step and every `eval_steps`.

    .venv/bin/python studies/learning_study.py                   # the CPU study in docs/results.md
    .venv/bin/python studies/learning_study.py --modes mt_grpo outcome_only --seeds 1
    python studies/learning_study.py --modes mt_grpo outcome_only --seeds 2 --runs outputs/study_gpu \
        --out studies/data/learning_study_gpu -- --use_cpu false --bf16 true --max_steps 60 --eval_max_samples 95

Flags after `--` go to every run (any recipe field). `--recipe` studies another task, e.g. the TextWorld game
(hf_recipes/SmolLM2-135M-Instruct/textworld_quest.yaml) with `--metrics eval/won ...`; its per_turn mode keeps the
recipe's turn rewards (the knowledge base's per-turn functions are for study.yaml). Runs go to
outputs/study/<mode>-s<seed>/ and run `--parallel` at a time (default 1; a CPU study run peaks at about 3.3 GiB,
so two fit on a 24 GiB machine, sharing its cores; on an H200 two runs held 4-8 GiB together).
A run that already finished is reused (delete its folder, or pass --fresh, to redo it), and a run
stopped by --deadline resumes from the checkpoint it saved. `--budget MIN` gives every run the same wall
time (time to accuracy, issue 22) through the trainer's `max_train_minutes`: a run evaluates at the step
that passes it, saves and stops, and is then done, not resumed. Writes OUT.csv (one row per
run and evaluation, with the minutes the run had trained by then), OUT.png (eval exact match, tool
success, first-search hit and tool calls per episode against step, and exact match and first-search hit
against minutes of training: a line per mode, the mean over seeds, with a band from the lowest to the
highest seed) and prints the table of the first and last evaluation per mode. `--compare studies/data/learning_study.csv`
then prints, evaluation by evaluation, how far this study lands from the committed one (the reproducibility check).

Intervals (issue 41): for each mode and evaluation, the mean of the first `--metrics` (eval exact match) over
seeds with a 95% interval from a two-level bootstrap (seeds drawn with replacement, then each drawn seed's
questions; `--bootstrap` draws from a fixed generator seed, so a rerun prints the same bounds), and the paired
differences mt_grpo - merged, mt_grpo - outcome_only, per_turn - mt_grpo (the three planned: PLANNED) and
per_turn - outcome_only (exploratory), those whose modes both ran (same seed, same question: a question that only
one mode evaluated is dropped and counted), each with its interval and whether it includes 0. Beside the bootstrap,
the seed-level test (seed_test): a paired t-interval over the seeds' mean differences and the exact sign-flip p over
seeds; the seeds' spread dominates here, and the bootstrap's interval is the narrower. Printed last, and written to
OUT_intervals.csv (INTERVAL_COLUMNS). The
per-question results are the episodes each evaluation records in <run>/rollouts/eval-step-NNNNNN.jsonl, which the
study asks the trainer for (`--save_rollouts_steps`, record_flags); runs without them (runs from before, the
stripped runs in studies/data/, an --include CSV) get intervals over seeds alone, marked "seeds only". `--report-only`
trains nothing: it reads the runs already in --runs, prints the tables and writes OUT_intervals.csv only:

    .venv/bin/python studies/learning_study.py --report-only --runs studies/data/learning_study_final_runs --out /tmp/final

`--keep DEST` copies each finished run's record to DEST/<mode>-s<seed>/, small enough to commit (keep_record:
trainer_state.json, the evaluation episodes without token arrays and prompt text, log.txt, each gzipped), after
checking that it gives the run's per-question results and logged means. A study spread over several machines commits
each run's record as it finishes, and the same command with `--runs DEST` then trains nothing and reports on them.
"""

import argparse
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import yaml

from common import ROOT, print_table

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from plot_runs import load_log_history  # noqa: E402
from view_rollouts import open_record, record_file, without_tokens, write_gzipped  # noqa: E402

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
    state = record_file(os.path.join(path, "trainer_state.json"))  # a kept run's is gzipped
    if state is None:
        return False
    with open_record(state) as f:
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
            "--seed", str(seed), "--output_dir", path, *mode_flags, *record_flags(recipe), *flags,
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
    makes a run's command (studies/peer_trl.py runs its own workers). Returns the failed runs."""
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


def write_csv(rows: list[dict], path: str, metrics: list[str] = METRICS,
              columns: list[str] | None = None) -> None:
    """OUT.csv (`columns` None: the run, the evaluation and `metrics`), or OUT_intervals.csv (INTERVAL_COLUMNS)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns or ["mode", "seed", "step", "minutes", *metrics])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})


def evaluation_points(runs: list[dict[int, set[int]]]) -> list[tuple[str, list[dict[int, int]]]]:
    """Where runs meet, for one mode (one dict) or a pair of modes (two), each dict {seed: steps it evaluated},
    over the seeds that all of them ran: each step that every run evaluated, then, when any run stopped elsewhere
    (a time budget stops each where its own steps run out), one point for where they stopped: each run's last
    evaluation. A mean over only the runs that reached a step would show one seed's value as the mode's.
    Returns (label, [{seed: step} per dict]); the label is the step, or "last: 26/27" (the seeds' steps, with
    " vs " between the modes')."""
    seeds = sorted(set.intersection(*(set(run) for run in runs))) if runs else []
    if not seeds:
        return []
    shared = sorted(set.intersection(*(run[seed] for run in runs for seed in seeds)))
    points = [(str(step), [dict.fromkeys(seeds, step) for _ in runs]) for step in shared]
    lasts = [{seed: max(run[seed]) for seed in seeds} for run in runs]
    if not shared or any(step != shared[-1] for last in lasts for step in last.values()):
        label = " vs ".join("/".join(str(last[seed]) for seed in seeds) for last in lasts)
        points.append((f"last: {label}", lasts))
    return points


def curve(rows: list[dict], mode: str, metric: str) -> list[tuple[float, float, list[float]]]:
    """A mode's points for one metric (evaluation_points), as (step, minutes, values over seeds); the step and
    minutes of a point where the seeds stopped at different steps are the mean over seeds. Minutes are NaN for
    runs from before the time axis; NaN values (no tool call, so no success rate) are left out, and a point with
    none is dropped."""
    runs: dict[int, dict[int, dict]] = {}
    for row in rows:
        if row["mode"] == mode:
            runs.setdefault(row["seed"], {})[row["step"]] = row
    points = []
    for _, (point,) in evaluation_points([{seed: set(run) for seed, run in runs.items()}] if runs else []):
        group = [runs[seed][step] for seed, step in point.items()]
        minutes = [row["minutes"] for row in group if not math.isnan(row["minutes"])]
        values = [row[metric] for row in group if not math.isnan(row[metric])]
        if values:
            points.append((sum(point.values()) / len(point), sum(minutes) / len(minutes) if minutes else math.nan,
                           values))
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


# ------------------------------------------------------------------------------------------------
# Intervals (issue 41): how sure is a mode's mean, and a difference between modes, at each evaluation
# ------------------------------------------------------------------------------------------------
BOOTSTRAP_SEED = 0  # every interval draws from its own generator with this seed: a rerun prints the same table
# the differences the study reports, each taken where both modes ran, with what they contrast: the first three were
# planned before the entity-split runs (commit 86ccc5e), the fourth is exploratory. per_turn trains on other turn
# rewards than mt_grpo (MODE_FLAGS: per-turn execution and answer-in-result rewards and a -0.2 penalty for a
# repeated query), so per_turn - mt_grpo contrasts reward and credit together, not credit alone.
DIFFERENCES = [("mt_grpo", "merged"), ("mt_grpo", "outcome_only"), ("per_turn", "mt_grpo"),
               ("per_turn", "outcome_only")]
PLANNED = {("mt_grpo", "merged"), ("mt_grpo", "outcome_only"), ("per_turn", "mt_grpo")}
INTERVAL_COLUMNS = ["kind", "name", "plan", "metric", "step", "seeds", "questions", "dropped_questions", "bootstrap",
                    "mean", "low", "high", "verdict", "t_low", "t_high", "sign_flip_p", "seed_sd", "seeds_for_effect"]
EFFECT, POWER = 0.05, 0.8  # the sized study: resolve a 0.05 difference of exact match with 80% power (docs/results.md)
SIGN_FLIP_EXACT = 16  # seeds up to which the sign-flip p enumerates all 2^n signs; past it, SIGN_FLIP_DRAWS draws
SIGN_FLIP_DRAWS = 200_000
RECORDED_EVAL = re.compile(r"^eval-step-(\d+)\.jsonl(\.gz)?$")  # the trainer's evaluation records (evaluation.py)


def record_flags(recipe: str) -> list[str]:
    """Makes the trainer record each evaluation's episodes, the per-question results the intervals need:
    `save_rollouts_steps N` records every evaluation and every N-th training rollout, so a recipe's own N is
    kept, and otherwise N is past any run's rollouts (only the first is recorded, a few hundred KiB)."""
    with open(recipe) as f:
        return [] if (yaml.safe_load(f) or {}).get("save_rollouts_steps") else ["--save_rollouts_steps", "1000000"]


def episode_value(record: dict, metric: str) -> float | None:
    """One recorded evaluation episode's value of `metric`, the one the trainer's eval_metrics averages over
    episodes. A task metric (tasks.QA_EVAL_METRICS: eval/<name> is the share of episodes where its reward
    function is > 0) is read from the episode's rewards, so only when that function is one of the run's reward
    functions; an outcome reward (eval/rewards/outcome/<name>) is its recorded value. None when the record does
    not hold it (or an outcome reward scored None, not applicable), or the metric is no mean over episodes
    (tool_success_rate: failed calls over calls)."""
    from mt_grpo.tasks import QA_EVAL_METRICS

    name = metric.removeprefix("eval/")
    if name.startswith("rewards/outcome/"):
        value = record["rewards"].get("outcome", {}).get(name.removeprefix("rewards/outcome/"))
        return None if value is None else float(value)
    if name == "answered_ratio":
        return float(record["stop_reason"] == "answer")
    if name == "tool_calls_per_episode":
        return float(len(record["tool_calls"]))
    function = QA_EVAL_METRICS.get(name)
    rewards = {**record["rewards"].get("turn", {}), **record["rewards"].get("outcome", {})}
    if function not in rewards:
        return None
    return float((rewards[function] or 0.0) > 0)  # None is "not applicable" (reporting._number): not a hit


def question_results(path: str, metric: str) -> dict[int, dict[int, float]]:
    """{step: {question: value of `metric`}} from the evaluations a run recorded (rollouts/eval-step-NNNNNN.jsonl,
    one record per episode; record_flags). A question is its row in the eval set (`group`), the same in every
    run of a study; its value is the mean over its episodes (k of them with num_generations_eval). Empty when
    the run recorded no evaluation, or its records do not hold the metric (episode_value)."""
    folder, results = os.path.join(path, "rollouts"), {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if (match := RECORDED_EVAL.match(name)) is None:
            continue
        episodes: dict[int, list[float]] = {}
        with open_record(os.path.join(folder, name)) as f:
            for line in filter(str.strip, f):
                record = json.loads(line)
                if (value := episode_value(record, metric)) is None:
                    return {}
                episodes.setdefault(record["group"], []).append(value)
        results[int(match.group(1))] = {q: sum(v) / len(v) for q, v in episodes.items()}
    return results


def keep_record(path: str, dest: str, metric: str) -> int:
    """Copy what the study's report reads of a finished run to `dest`, small enough to commit, each file gzipped
    (write_gzipped; every reader opens them directly): trainer_state.json.gz (the logged means; `done` reads it, so
    the study command with `--runs` over the kept folders reports without training), rollouts/eval-step-NNNNNN.jsonl.gz
    without token arrays and prompt text (`without_tokens`; the per-question results) and log.txt.gz with this
    machine's paths made relative. Checks that the kept records give the run's own per-question results and logged
    means of `metric`; returns the number of evaluation episodes kept."""
    os.makedirs(os.path.join(dest, "rollouts"), exist_ok=True)
    with open_record(record_file(os.path.join(path, "trainer_state.json"))) as f:
        write_gzipped(os.path.join(dest, "trainer_state.json.gz"), f.read())
    kept = 0
    for name in sorted(os.listdir(os.path.join(path, "rollouts"))):
        if RECORDED_EVAL.match(name):
            with open_record(os.path.join(path, "rollouts", name)) as f:
                lines = [json.dumps(without_tokens(json.loads(line))) + "\n" for line in filter(str.strip, f)]
            write_gzipped(os.path.join(dest, "rollouts", name.removesuffix(".gz") + ".gz"), "".join(lines))
            kept += len(lines)
    if (log := record_file(os.path.join(path, "log.txt"))) is not None:
        with open_record(log) as f:
            text = f.read().replace(os.path.abspath(path), "<run>").replace(ROOT, ".")
        write_gzipped(os.path.join(dest, "log.txt.gz"), text)
    results = question_results(dest, metric)
    if results != question_results(path, metric):
        raise SystemExit(f"The records kept in {dest} do not give {path}'s per-question results of {metric}.")
    logged = {h["step"]: h[metric] for h in load_log_history(dest) if metric in h}
    for step, per_question in results.items():  # the trainer's logged mean is the mean over the recorded questions
        if step not in logged or abs(sum(per_question.values()) / len(per_question) - logged[step]) > 1e-6:
            raise SystemExit(f"{path}: the recorded episodes of step {step} do not give the logged {metric} "
                             f"{logged.get(step)} (the records are not the evaluation that was logged).")
    return kept


def two_level_bootstrap(groups: list[np.ndarray], n: int, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """(n,) resampled means of per-seed values (groups: one array per seed, a value per question): draw as many
    seeds as there are, with replacement, then each drawn seed's questions with replacement; the mean over a
    seed's questions, then over the drawn seeds, as the point estimate weighs them. Both levels vary between
    reruns: the seed (training noise) and the questions (which 32 the test split happens to hold). A seed with
    one value (its logged mean, when there are no per-question results) is resampled over seeds only."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(groups), size=(n, len(groups)))  # (n, S): the seed each draw's slot takes
    means = np.empty(picks.shape)
    for s, values in enumerate(groups):
        slots = picks == s
        questions = rng.integers(0, len(values), size=(int(slots.sum()), len(values)))  # (slots, Q_s)
        means[slots] = values[questions].mean(axis=1)
    return means.mean(axis=1)


def point_groups(modes: tuple[str, ...], point: list[dict[int, int]], logged: dict,
                 results: dict) -> tuple[list[np.ndarray], str, int, str]:
    """The per-seed values at one evaluation point of a mode (one mode) or of a difference (two: the first mode's
    minus the second's, paired by seed and question; a question that only one of them evaluated is dropped).
    Returns (groups, questions per seed, questions dropped, what the bootstrap resamples). Each seed's logged mean
    stands for it (a bootstrap over seeds only) unless every run has per-question results at the point."""
    sign = (1.0, -1.0)
    seeds = list(point[0])
    runs = {seed: [results.get((mode, seed), {}).get(at[seed]) for mode, at in zip(modes, point)] for seed in seeds}
    if all(all(answers) for answers in runs.values()):
        shared = {seed: sorted(set.intersection(*map(set, answers))) for seed, answers in runs.items()}
        if all(shared.values()):
            groups = [sum(s * np.array([answers[q] for q in shared[seed]]) for s, answers in zip(sign, runs[seed]))
                      for seed in seeds]
            dropped = sum(len(set.union(*map(set, runs[seed]))) - len(shared[seed]) for seed in seeds)
            return groups, "/".join(str(len(shared[seed])) for seed in seeds), dropped, "seeds x questions"
    groups = [np.array([sum(s * logged[(mode, seed, at[seed])] for s, mode, at in zip(sign, modes, point))])
              for seed in seeds]
    return groups, "", 0, "seeds only"


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom: its density integrated by Simpson's rule
    (4,000 panels on [0, x]) and the bound found by bisection, to about 1e-7 (numpy has no t quantile, and the
    project carries no scipy). t_quantile(0.975, 4) = 2.7764."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float) -> float:
        grid = np.linspace(0.0, x, 4001)
        density = scale * (1 + grid**2 / df) ** (-(df + 1) / 2)
        return 0.5 + (x / 4000 / 3) * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())

    low, high = 0.0, 1.0
    while cdf(high) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def seed_test(values: list[float], seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float]:
    """The seed-level test of a mean over seeds (one value per seed: a mode's mean exact match, or a paired
    difference's mean over the seed's questions): the 95% t-interval, mean +- t(0.975, n-1) * SD / sqrt(n), and the
    two-sided sign-flip (randomisation) p: the share of the 2^n ways to flip the signs of the n values whose mean is
    at least as far from 0 as the one observed; exact (every sign vector) for up to SIGN_FLIP_EXACT seeds, past that
    (k + 1) / (draws + 1) with k of SIGN_FLIP_DRAWS random sign vectors (generator `seed`) as far. Seeds are the
    unit that varies between reruns (every run answers the same questions), so this tests whether a difference holds
    over seeds; with n seeds the smallest p is 2 / 2^n (0.0625 at 5). Returns (t_low, t_high, p), NaN for one seed.
    """
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < 2:
        return math.nan, math.nan, math.nan
    half = t_quantile(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n)
    if n <= SIGN_FLIP_EXACT:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)  # (2^n, n): every sign vector
    else:
        signs = np.random.default_rng(seed).choice([-1, 1], size=(SIGN_FLIP_DRAWS, n))
    as_far = int((np.abs(signs @ x) >= abs(x.sum()) - 1e-12).sum())
    p = as_far / len(signs) if n <= SIGN_FLIP_EXACT else (as_far + 1) / (len(signs) + 1)  # drawn: never 0
    return float(x.mean() - half), float(x.mean() + half), p


def t_test_power(n: int, sd: float, effect: float = EFFECT, draws: int = 20_000, seed: int = BOOTSTRAP_SEED) -> float:
    """The power of the paired t-test over `n` seeds (two-sided, 0.05: seed_test's t-interval excludes 0) when the
    true mean difference is `effect` and a seed's difference has SD `sd`: the share of `draws` simulated studies of
    normal per-seed differences (generator `seed`, so the same call gives the same number) that find it."""
    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0
    x = np.random.default_rng(seed).normal(effect, sd, size=(draws, n))  # (draws, n): a simulated study per row
    t = x.mean(axis=1) / (x.std(axis=1, ddof=1) / math.sqrt(n))
    return float((np.abs(t) > t_quantile(0.975, n - 1)).mean())


def seeds_needed(sd: float, effect: float = EFFECT, power: float = POWER, most: int = 400) -> int:
    """The fewest seeds per mode at which the paired t-test reaches `power` for `effect` (t_test_power), given a
    seed's SD; `most` + 1 when not even `most` seeds do. Seeds 0.111 apart (mt_grpo - merged, step 30): 41."""
    guess = max(2, math.floor(((1.96 + 0.84) * sd / effect) ** 2))  # the normal approximation, a lower bound
    if guess > most:
        return most + 1
    n = guess
    while n <= most and t_test_power(n, sd, effect) < power:
        n += 1
    while n > 2 and t_test_power(n - 1, sd, effect) >= power:  # the approximation overshot (few seeds)
        n -= 1
    return n


def verdict(low: float, high: float, seeds_only: int = 0) -> str:
    """Whether a difference's interval includes 0; `seeds_only`: the number of seeds it rests on alone (two seeds
    that agree give an interval of one point, which excludes 0 without saying much)."""
    if math.isnan(low):
        return "no interval (one seed, no per-question results)"
    said = "interval includes 0" if low <= 0 <= high else \
        f"excludes 0 (lower bound {low:.3f})" if low > 0 else f"excludes 0 (upper bound {high:.3f})"
    return f"{said}, over {seeds_only} seeds only" if seeds_only else said


def intervals(rows: list[dict], results: dict[tuple[str, int], dict], metric: str, n: int = 2000,
              seed: int = BOOTSTRAP_SEED) -> list[dict]:
    """OUT_intervals.csv: the mean of `metric` over seeds with a 95% percentile interval (two_level_bootstrap,
    `n` draws) for each mode at each evaluation point (evaluation_points), then for each difference in DIFFERENCES
    whose modes both ran, over the seeds both ran. `rows` as `collect` makes them (the logged means);
    `results`: {(mode, seed): question_results}. An interval from one seed's logged mean alone is NaN."""
    logged = {(r["mode"], r["seed"], r["step"]): r[metric] for r in rows if not math.isnan(r.get(metric, math.nan))}
    steps: dict[str, dict[int, set[int]]] = {}
    for mode, run_seed, step in logged:
        steps.setdefault(mode, {}).setdefault(run_seed, set()).add(step)
    names = [(mode, (mode,)) for mode in steps] + [(f"{a} - {b}", (a, b)) for a, b in DIFFERENCES
                                                   if a in steps and b in steps]
    table = []
    for name, modes in names:
        for label, point in evaluation_points([steps[mode] for mode in modes]):
            groups, questions, dropped, resampled = point_groups(modes, point, logged, results)
            mean = float(np.mean([g.mean() for g in groups]))
            low, high = (np.percentile(two_level_bootstrap(groups, n, seed), [2.5, 97.5])
                         if len(groups) > 1 or resampled != "seeds only" else (math.nan, math.nan))
            per_seed = [g.mean() for g in groups]
            t_low, t_high, p = seed_test(per_seed, seed)
            sd = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else math.nan
            table.append({"kind": "mode" if len(modes) == 1 else "difference", "name": name,
                          "plan": "" if len(modes) == 1 else "planned" if modes in PLANNED else "exploratory",
                          "metric": metric, "step": label, "seeds": "/".join(map(str, point[0])),
                          "questions": questions, "dropped_questions": dropped, "bootstrap": resampled, "mean": mean,
                          "low": float(low), "high": float(high), "verdict": "" if len(modes) == 1 else
                          verdict(low, high, len(groups) if resampled == "seeds only" else 0),
                          "t_low": t_low, "t_high": t_high, "sign_flip_p": math.nan if len(modes) == 1 else p,
                          "seed_sd": sd, "seeds_for_effect": "" if len(modes) == 1 or math.isnan(sd) else
                          seeds_needed(sd)})
    return table


def print_intervals(table: list[dict], n: int) -> None:
    cell = lambda r: f"{r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"  # noqa: E731
    metric = table[0]["metric"] if table else ""
    print_table(f"{metric}: mean over seeds with a 95% interval ({n} bootstrap draws over seeds, then over each "
                "seed's questions; 'seeds only' where a run recorded no per-question results)",
                ["mode", "step", "mean [95% interval]", "seeds", "questions per seed", "bootstrap"],
                [[r["name"], r["step"], cell(r), r["seeds"], r["questions"] or "n/a", r["bootstrap"]]
                 for r in table if r["kind"] == "mode"])
    print_table(f"{metric}: differences, paired by seed and question (a question only one mode evaluated is "
                "dropped), with the bootstrap's 95% interval and the seed-level test (a paired t-interval over the "
                "seeds' mean differences and the exact sign-flip p over seeds)",
                ["difference", "plan", "step", "mean [95% interval]", "t-interval over seeds", "sign-flip p", "seeds",
                 "questions per seed", "dropped", "bootstrap", "verdict", "seed SD", f"seeds for {EFFECT}"],
                [[r["name"], r["plan"], r["step"], cell(r), f"[{r['t_low']:.3f}, {r['t_high']:.3f}]",
                  f"{r['sign_flip_p']:.4f}", r["seeds"], r["questions"] or "n/a", r["dropped_questions"],
                  r["bootstrap"], r["verdict"], f"{r['seed_sd']:.3f}", r["seeds_for_effect"]]
                 for r in table if r["kind"] == "difference"])
    print(f"seeds for {EFFECT}: the seeds per mode at which the paired t-test finds a true difference of {EFFECT} "
          f"with {POWER:.0%} power, if a seed's difference has the SD measured here (seeds_needed)")
    if any(r["bootstrap"] == "seeds only" for r in table):
        print("seeds only: some runs recorded no per-question results (rollouts/eval-step-*.jsonl, written with "
              "--save_rollouts_steps, which the study passes), or their records do not hold the metric; those "
              "intervals are over seeds alone, so they leave out the questions' sampling noise")


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
    ap.add_argument("--out", default=os.path.join(ROOT, "studies", "data", "learning_study"), help="OUT.csv and OUT.png")
    ap.add_argument("--fresh", action="store_true", help="redo runs that already finished")
    ap.add_argument("--deadline", type=float, help="seconds; then running runs stop after their step (SIGTERM)")
    ap.add_argument("--budget", type=float, help="minutes of wall time per run (max_train_minutes): the run then "
                    "evaluates, saves and stops after its step, and counts as done (it is not resumed)")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between run starts")
    ap.add_argument("--compare", metavar="CSV", help="an earlier study's CSV: print the differences, row by row")
    ap.add_argument("--include", metavar="CSV", help="an earlier study's CSV: its runs (mode and seed) that are not "
                    "in this study are kept in OUT.csv, the plot and the tables (to add a mode without rerunning the "
                    "rest; their intervals are over seeds only)")
    ap.add_argument("--report-only", action="store_true", help="train nothing: read the runs in --runs (finished or "
                    "not), print the tables and write OUT_intervals.csv (OUT.csv and OUT.png are left as they are)")
    ap.add_argument("--keep", metavar="DEST", help="copy each finished run's record (trainer_state.json, the "
                    "evaluation episodes without token arrays and prompt text, log.txt) to DEST/<mode>-s<seed>/ to "
                    "commit it; `--runs DEST` then reports on the kept runs without training (keep_record)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap draws per interval (2000 recommended: "
                    "more draws, steadier bounds)")
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    jobs = [(mode, seed, run_dir(args.runs, mode, seed)) for seed in args.seeds for mode in args.modes]
    budgeted = args.budget is not None
    start, todo, failed = time.monotonic(), [], []
    if args.report_only:  # every run that logged, finished or stopped: nothing is trained or resumed
        ran = [j for j in jobs if record_file(os.path.join(j[2], "trainer_state.json"))]
    else:
        todo = [j for j in jobs if args.fresh or not done(j[2], budgeted)]
        if args.fresh:
            for _, _, path in todo:
                shutil.rmtree(path, ignore_errors=True)
        failed = run_all(todo, flags + budget_flags(args.budget), args.parallel, args.deadline, args.stagger,
                         command_fn=lambda *a: command(*a, recipe=args.recipe))
        ran = [j for j in jobs if done(j[2], budgeted) and j[2] not in failed]
    rows = collect(ran, args.metrics)
    if args.keep:
        for mode, seed, path in ran:  # finished runs only (--report-only also reads runs stopped early)
            if done(path, budgeted) and os.path.abspath(path) != os.path.abspath(run_dir(args.keep, mode, seed)):
                episodes = keep_record(path, run_dir(args.keep, mode, seed), args.metrics[0])
                print(f"kept {mode} seed {seed}: {episodes} evaluation episodes -> {run_dir(args.keep, mode, seed)}")
    if args.include:
        rows = with_earlier_runs(rows, read_csv(args.include))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    written = [args.out + "_intervals.csv"]
    if not args.report_only:
        write_csv(rows, args.out + ".csv", args.metrics)
        seeds = {m: len({r["seed"] for r in rows if r["mode"] == m}) for m in dict.fromkeys(r["mode"] for r in rows)}
        plot(rows, args.out + ".png", f"{args.title}, seeds per mode: " +
             ", ".join(f"{m} {n}" for m, n in seeds.items()), args.metrics)
        written = [args.out + ".csv", args.out + ".png", *written]
    summary(rows, args.metrics)
    if args.compare:
        unmatched, table = compare(rows, args.compare)
        print_table(f"Against {args.compare}, evaluation by evaluation ({unmatched} without a counterpart there)",
                    ["metric", "compared", "identical", "largest difference"], table)
    table = intervals(rows, {(mode, seed): question_results(path, args.metrics[0]) for mode, seed, path in ran},
                      args.metrics[0], args.bootstrap)
    print_intervals(table, args.bootstrap)
    write_csv(table, written[-1], columns=INTERVAL_COLUMNS)
    print(f"\n{len(todo)} runs in {(time.monotonic() - start) / 60:.1f} min; wrote {', '.join(written)}")
    if failed:
        raise SystemExit(f"{len(failed)} runs failed (left out above); their logs: {[f + '/log.txt' for f in failed]}")


if __name__ == "__main__":
    main()
