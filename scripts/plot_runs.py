"""Plot training curves of one or more runs from their trainer_state.json, overlaid, into one PNG grid.

    python scripts/plot_runs.py outputs/cpu_demo                  # -> outputs/cpu_demo/run_plots.png
    python scripts/plot_runs.py outputs/cpu_demo --out docs       # the docs image, docs/run_plots.png
    python scripts/plot_runs.py outputs/mt_grpo outputs/outcome_only --labels mt-grpo outcome-only --out docs

Panels (each drawn only if some run logged one of its metrics): turn and outcome reward means per
function, tool success and answered ratio, eval metrics (`eval/...`), loss, kl, clip ratio, the
sampler-trainer logprob differences, and rollout seconds, all against the optimizer step. With one run
each metric gets its own colour; with several, each run gets a colour and each metric a line style.
From a study script: `from plot_runs import plot_runs; plot_runs([(label, log_history), ...], path)`.
"""

import argparse
import glob
import math
import json
import os

from matplotlib.figure import Figure  # no pyplot: no global backend state, PNGs go through Agg

from view_rollouts import open_record, record_file  # run records, plain or gzipped (studies/data/*_runs/)

# (title, metric names; a name ending in "/" stands for every metric under it)
PANELS = [
    ("turn rewards", ["rewards/turn/"]),
    ("outcome rewards", ["rewards/outcome/"]),
    ("rollout", ["rollout/tool_success_rate", "rollout/answered_ratio"]),
    ("eval", ["eval/"]),
    ("loss", ["loss"]),
    ("kl", ["kl"]),
    ("clip ratio (region mean)", ["clip_ratio/region_mean"]),
    ("|sampler - trainer| logprob", ["sampling/logprob_diff_first_turn", "sampling/logprob_diff_later_turns"]),
    ("rollout seconds", ["rollout/seconds"]),
]
NOT_A_REWARD = "frac_zero_std_groups"  # logged under rewards/ but a fraction of groups, not a reward
LINE_STYLES = ["-", "--", ":", "-."]


def load_log_history(run_dir: str) -> list[dict]:
    """log_history of RUN_DIR/trainer_state.json (or .json.gz, as studies/data/*_runs/ keep it), else of the newest
    checkpoint-*/trainer_state.json."""
    path = record_file(os.path.join(run_dir, "trainer_state.json"))
    if path is None:
        checkpoints = glob.glob(os.path.join(run_dir, "checkpoint-*", "trainer_state.json"))
        if not checkpoints:
            raise SystemExit(f"No trainer_state.json in {run_dir} or its checkpoint-* folders.")
        path = max(checkpoints, key=lambda p: int(p.split("checkpoint-")[-1].split(os.sep)[0]))
    with open_record(path) as f:
        return json.load(f)["log_history"]


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping entries without it and values that are not finite numbers."""
    points = [(h["step"], h[key]) for h in history
              if isinstance(h.get(key), (int, float)) and math.isfinite(h[key]) and "step" in h]
    return [s for s, _ in points], [v for _, v in points]


def panel_metrics(histories: list[list[dict]], names: list[str]) -> list[str]:
    """The logged metrics a panel's names match, means last so that per-function lines come first."""
    logged = {k for history in histories for h in history for k in h}
    found = []
    for name in names:
        matches = sorted(k for k in logged if k.startswith(name) and NOT_A_REWARD not in k) if name.endswith("/") \
            else [name] if name in logged else []
        found += sorted(matches, key=lambda k: k.endswith("/mean"))
    return found


def plot_runs(runs: list[tuple[str, list[dict]]], out_path: str, columns: int = 3) -> str | None:
    """Draw every panel that has data for (label, log_history) runs into one PNG; None if nothing to plot."""
    histories = [history for _, history in runs]
    panels = [(title, metrics) for title, names in PANELS if (metrics := panel_metrics(histories, names))]
    if not panels:
        return None
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(5 * columns, 3.2 * rows), dpi=90, layout="constrained")
    for p, (title, metrics) in enumerate(panels):
        ax = fig.add_subplot(rows, columns, p + 1)
        prefix = os.path.commonprefix(metrics).rpartition("/")[0] + "/" if len(metrics) > 1 else ""
        for r, (label, history) in enumerate(runs):
            for m, metric in enumerate(metrics):
                steps, values = series(history, metric)
                if not steps:
                    continue
                name = metric[len(prefix):]
                if len(runs) == 1:
                    style = {"color": f"C{m}", "label": name}
                else:
                    style = {"color": f"C{r}", "linestyle": LINE_STYLES[m % 4],
                             "label": f"{label}: {name}" if len(metrics) > 1 else label}
                ax.plot(steps, values, marker="o" if len(steps) < 15 else None, markersize=3, linewidth=1.2, **style)
        ax.set_title(title if len(metrics) > 1 else metrics[0], fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(metrics) > 1 or len(runs) > 1:
            ax.legend(fontsize=7)
    fig.savefig(out_path)
    return out_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="output_dir of each run (holding trainer_state.json)")
    parser.add_argument("--out", help="folder for run_plots.png (default: the first run's folder)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: folder names)")
    args = parser.parse_args()
    labels = args.labels or [os.path.basename(os.path.normpath(d)) for d in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(args.run_dirs)} runs.")
    out_dir = args.out or args.run_dirs[0]
    os.makedirs(out_dir, exist_ok=True)
    path = plot_runs([(label, load_log_history(d)) for label, d in zip(labels, args.run_dirs)],
                     os.path.join(out_dir, "run_plots.png"))
    print(f"wrote {path}" if path else "nothing to plot: no known metric in log_history")


if __name__ == "__main__":
    main()
