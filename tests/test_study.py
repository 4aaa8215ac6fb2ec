"""The learning study's bookkeeping (studies/learning_study.py): one CSV row per run and evaluation
read from trainer_state.json, and the row-by-row comparison with an earlier CSV that checks a rerun."""

import csv
import gzip
import json
import math
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "studies"))

from learning_study import METRICS, collect, compare, csv_difference, read_csv, with_earlier_runs, write_csv  # noqa: E402


def write_run(folder, evals: dict[int, dict]):
    """A trainer_state.json whose log history holds training rows and the given evaluations."""
    os.makedirs(folder)
    history = []
    for step, metrics in evals.items():
        history.append({"step": step, "loss": 0.1})
        history.append({"step": step, **{f"eval/{k}": v for k, v in metrics.items()}})
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"log_history": history}, f)


def evaluation(exact_match, calls):
    # no call: the success rate is undefined and the trainer logs NaN
    return {"exact_match": exact_match, "tool_success_rate": 1.0 if calls else math.nan,
            "first_search_hit": 0.5, "answered_ratio": 1.0, "tool_calls_per_episode": calls}


def test_rows_per_evaluation_and_an_identical_rerun_compares_equal(tmp_path):
    runs = [("mt_grpo", 1, str(tmp_path / "mt_grpo-s1")), ("outcome_only", 1, str(tmp_path / "outcome_only-s1"))]
    write_run(runs[0][2], {0: evaluation(0.0, 0.375), 10: evaluation(1 / 32, 1.0)})
    write_run(runs[1][2], {0: evaluation(0.0, 0.375), 10: evaluation(0.0, 0.0)})
    rows = collect(runs)
    assert [(r["mode"], r["step"]) for r in rows] == [("mt_grpo", 0), ("mt_grpo", 10), ("outcome_only", 0),
                                                      ("outcome_only", 10)]
    assert rows[1]["eval/exact_match"] == 1 / 32 and math.isnan(rows[3]["eval/tool_success_rate"])
    reference = str(tmp_path / "study.csv")
    write_csv(rows, reference)
    unmatched, table = compare(rows, reference)
    assert unmatched == 0
    # 1/32 is written as 0.0312 and must still count as identical; NaN matches NaN
    assert table == [[m, 4, 4, 0.0] for m in METRICS]


def test_a_changed_evaluation_is_reported_with_its_size(tmp_path):
    runs = [("mt_grpo", 1, str(tmp_path / "mt_grpo-s1"))]
    write_run(runs[0][2], {0: evaluation(0.0, 0.375), 10: evaluation(0.125, 1.0)})
    reference = str(tmp_path / "study.csv")
    write_csv(collect(runs), reference)
    os.remove(os.path.join(runs[0][2], "trainer_state.json"))
    os.rmdir(runs[0][2])
    # the rerun: one question more right at step 10, no tool call at all at step 0, and a step 20
    write_run(runs[0][2], {0: evaluation(0.0, 0.0), 10: evaluation(0.15625, 1.0), 20: evaluation(0.2, 1.0)})
    unmatched, table = compare(collect(runs), reference)
    assert unmatched == 1
    by_metric = {row[0]: row[1:] for row in table}
    assert by_metric["eval/exact_match"][:2] == [2, 1]
    assert math.isclose(by_metric["eval/exact_match"][2], 0.1562 - 0.125)
    assert by_metric["eval/tool_success_rate"] == [2, 1, math.inf]  # NaN against 1.0
    assert by_metric["eval/tool_calls_per_episode"] == [2, 1, 0.375]
    assert by_metric["eval/answered_ratio"] == [2, 2, 0.0]


def test_csv_difference_rounds_like_the_csv():
    assert csv_difference(1 / 3, 0.3333) == 0.0
    assert math.isclose(csv_difference(0.5, 0.25), 0.25)
    assert csv_difference(math.nan, math.nan) == 0.0
    assert csv_difference(math.nan, 0.0) == math.inf and csv_difference(0.0, math.nan) == math.inf


def test_an_earlier_csv_keeps_the_runs_this_study_did_not_make(tmp_path):
    """--include: a new mode joins the committed study without rerunning the others; a rerun replaces its old rows."""
    old = [("mt_grpo", 1, str(tmp_path / "mt_grpo-s1")), ("per_turn", 1, str(tmp_path / "old-per_turn-s1"))]
    write_run(old[0][2], {0: evaluation(0.0, 0.375), 10: evaluation(0.125, 1.0)})
    write_run(old[1][2], {0: evaluation(0.0, 0.375)})
    earlier = str(tmp_path / "earlier.csv")
    write_csv(collect(old), earlier)
    new = [("per_turn", 1, str(tmp_path / "per_turn-s1"))]
    write_run(new[0][2], {0: evaluation(0.0, 0.375), 10: evaluation(0.25, 1.0)})
    rows = with_earlier_runs(collect(new), read_csv(earlier))
    assert [(r["mode"], r["step"]) for r in rows] == [("mt_grpo", 0), ("mt_grpo", 10), ("per_turn", 0), ("per_turn", 10)]
    assert rows[1]["eval/exact_match"] == 0.125 and rows[3]["eval/exact_match"] == 0.25


def test_a_run_stopped_at_the_deadline_resumes_and_a_finished_one_is_reused(tmp_path):
    from learning_study import command, done, finished

    path = str(tmp_path / "mt_grpo-s1")
    assert not finished(path) and "--resume_from_checkpoint" not in command("mt_grpo", 1, path, [])
    os.makedirs(os.path.join(path, "checkpoint-12"))  # SIGTERM at step 12 of 30: GracefulStop saved it
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 12, "max_steps": 30, "log_history": []}, f)
    assert not finished(path)
    assert not done(path, budgeted=False) and done(path, budgeted=True)  # under --budget it stopped at its budget
    assert command("mt_grpo", 1, path, ["--kb_multi_hop", "0.5"])[-4:] == [
        "--kb_multi_hop", "0.5", "--resume_from_checkpoint", "last"]
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 30, "max_steps": 30, "log_history": []}, f)
    assert finished(path)


def test_each_evaluation_carries_the_minutes_trained_before_it(tmp_path):
    """The time axis: TRL's step_time of every step up to the evaluation's, summed; evaluation time is not in it."""
    from learning_study import plot

    path = str(tmp_path / "mt_grpo-s1")
    os.makedirs(path)
    history = [{"step": 0, **{f"eval/{k}": v for k, v in evaluation(0.0, 0.375).items()}}]
    history += [{"step": s, "loss": 0.1, "step_time": 60.0 + s} for s in range(1, 11)]
    history += [{"step": 10, **{f"eval/{k}": v for k, v in evaluation(0.125, 1.0).items()}}]
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"log_history": history}, f)
    rows = collect([("mt_grpo", 1, path)])
    assert [r["minutes"] for r in rows] == [0.0, (600 + 55) / 60]
    write_csv(rows, str(tmp_path / "s.csv"))
    assert read_csv(str(tmp_path / "s.csv"))[1]["minutes"] == round((600 + 55) / 60, 4)
    plot(rows, str(tmp_path / "s.png"), "t")
    assert os.path.getsize(tmp_path / "s.png") > 0


def test_runs_without_minutes_are_left_out_of_the_time_panels(tmp_path):
    """An older CSV's runs (minutes NaN) keep their step panels but draw no line against time."""
    from learning_study import plot

    rows = [{"mode": mode, "seed": 1, "step": step, "minutes": minutes,
             **{f"eval/{k}": v for k, v in evaluation(0.0, 0.5).items()}}
            for mode, minutes_at in (("outcome_only", {0: math.nan, 10: math.nan}), ("mt_grpo", {0: 0.0, 10: 11.0}))
            for step, minutes in minutes_at.items()]
    axes = plot(rows, str(tmp_path / "s.png"), "t").axes
    assert [line.get_label() for line in axes[0].lines] == ["outcome_only", "mt_grpo"]  # exact match per step
    for ax in axes[4:]:  # exact match and first-search hit against minutes
        assert [line.get_label() for line in ax.lines] == ["mt_grpo"]
        assert list(ax.lines[0].get_xdata()) == [0.0, 11.0]


def test_a_csv_from_before_the_time_axis_still_reads(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("mode,seed,step," + ",".join(METRICS) + "\nmt_grpo,1,0,0.0,1.0,0.375,0.625,0.375\n")
    (row,) = read_csv(str(path))
    assert math.isnan(row["minutes"]) and row["eval/first_search_hit"] == 0.375


def test_the_ablation_reads_each_levers_run_and_its_training_statistics(tmp_path):
    """studies/ablation.py: a lever is the study's MT-GRPO command plus its flags, and its row holds the
    evaluations, the minutes before each, and what the training log says (signal, exact answers, redraws)."""
    from ablation import LEVERS, lever_command, rows_of, table

    path = str(tmp_path / "dynamic_sampling-s1")
    cmd = lever_command("dynamic_sampling", 1, path, ["--max_steps", "20"])
    assert cmd[cmd.index("--advantage_mode") + 1] == "mt_grpo"
    assert cmd[-4:] == LEVERS["dynamic_sampling"][0] + ["--max_steps", "20"]
    os.makedirs(path)
    history = [{"step": 0, **{f"eval/{k}": v for k, v in evaluation(0.0, 0.375).items()}}]
    history += [{"step": s, "loss": 0.1, "step_time": 60.0, "rewards/frac_zero_signal_groups": float(s == 2),
                 "rewards/outcome/exact_match_reward_func": 0.125 * (s == 4),
                 "dynamic_sampling/groups_replaced": float(s == 3)} for s in range(1, 5)]
    history += [{"step": 4, **{f"eval/{k}": v for k, v in evaluation(0.25, 1.0).items()}}]
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"log_history": history}, f)
    rows = rows_of("dynamic_sampling", 1, path)
    assert [(r["step"], r["minutes"], r["eval/exact_match"]) for r in rows] == [(0, 0.0, 0.0), (4, 4.0, 0.25)]
    assert rows[1]["run/steps"] == 4 and rows[1]["run/seconds_per_step"] == 60.0
    assert rows[1]["run/zero_signal_share"] == 0.25 and rows[1]["run/train_exact_match"] == 0.125 / 4
    assert rows[1]["run/groups_replaced"] == 1.0
    (row,) = table(rows)
    assert row[:3] == ["dynamic_sampling", "--dynamic_sampling true", 4]
    assert row[5:8] == ["0/4", "0.000 / 0.250", "0.500 / 0.500"] and row[-1] == 1


def test_the_ablation_reads_what_dynamic_sampling_drew_not_what_it_trained_on():
    """With `dynamic_sampling/first_draw/` logged, the signal and exact-answer columns are the first draw's: the
    trained batch has its empty groups replaced, so its zero-signal share says nothing of the policy."""
    from ablation import lever_stats

    first = "dynamic_sampling/first_draw/"
    history = [{"step": s, "loss": 0.1, "rewards/frac_zero_signal_groups": 0.0,
                "rewards/outcome/exact_match_reward_func": 0.125, first + "rewards/outcome/mean": 0.2,
                first + "rewards/frac_zero_signal_groups": float(s == 2),
                first + "rewards/outcome/exact_match_reward_func": 0.0} for s in range(1, 5)]
    stats = lever_stats(history)
    assert stats["zero_signal_share"] == 0.25 and stats["train_exact_match"] == 0.0


def test_every_levers_command_is_a_recipe_the_trainer_parses():
    """A lever's flags are trainer fields with valid values: a typo would cost a 45-minute run its start."""
    from ablation import LEVERS, lever_command

    from mt_grpo_trainer import parse_args

    for lever, (flags, _) in LEVERS.items():
        cmd = lever_command(lever, 1, "outputs/x", [])
        script_args, training_args, _ = parse_args(cmd[2:])
        assert training_args.max_steps == 30 and script_args.advantage_mode == "mt_grpo", lever
        # questions per step: TRL's generation batch (micro-batch x accumulation) over the group size
        questions = training_args.generation_batch_size // training_args.num_generations
        assert questions == (2 if lever == "two_questions" else 1), lever
        if lever == "grounded_answer":
            assert "grounded_answer_reward_func" in script_args.outcome_reward_funcs



def test_a_budget_is_the_trainers_own_time_budget_in_every_run():
    """`--budget MIN` (the study and the ablation) becomes the trainer's `max_train_minutes` in each run's
    command; tests/test_reliability.py checks that the trainer then evaluates, saves and stops."""
    from ablation import lever_command
    from learning_study import budget_flags, command

    from mt_grpo_trainer import parse_args

    assert budget_flags(None) == []
    for cmd in (command("outcome_only", 2, "outputs/x", budget_flags(45)),
                lever_command("grounded_answer", 1, "outputs/x", budget_flags(45))):
        script_args, _, _ = parse_args(cmd[2:])
        assert script_args.max_train_minutes == 45.0


def test_seeds_stopped_at_different_steps_meet_at_their_budget_stop(capsys):
    """A time budget stops seed 1 at step 26 and seed 2 at step 27: the curve averages both seeds at each
    step both evaluated and at their stops (x = mean step and minutes), never one seed alone."""
    from learning_study import curve, summary

    def row(seed, step, minutes, em):
        return {"mode": "mt_grpo", "seed": seed, "step": step, "minutes": minutes,
                **{f"eval/{k}": v for k, v in evaluation(em, 1.0).items()}}

    rows = [row(1, 0, 0.0, 0.0), row(1, 10, 14.0, 0.25), row(1, 26, 38.0, 0.5),
            row(2, 0, 0.0, 0.0), row(2, 10, 16.0, 0.75), row(2, 27, 40.0, 1.0)]
    assert curve(rows, "mt_grpo", "eval/exact_match") == [(0.0, 0.0, [0.0, 0.0]), (10.0, 15.0, [0.25, 0.75]),
                                                         (26.5, 39.0, [0.5, 1.0])]
    summary(rows)
    line = next(line for line in capsys.readouterr().out.splitlines() if "eval/exact_match" in line)
    assert "step 26/27, 39.0 min: 0.750 (0.500-1.000)" in line
    # seeds that all stop at one step end there, with no extra point
    same = rows[:3] + [row(2, 0, 0.0, 0.0), row(2, 10, 16.0, 0.75), row(2, 26, 40.0, 1.0)]
    assert [p[0] for p in curve(same, "mt_grpo", "eval/exact_match")] == [0.0, 10.0, 26.0]


# -- intervals (issue 41): a two-level bootstrap over seeds and questions -------------------------------------------
def write_recorded_run(folder, answers: dict[int, list], record: bool = True):
    """A run whose evaluation at each step got `answers` (a question row's exact match, 1 or 0; None: the question
    was not evaluated): its logged means in trainer_state.json and, with `record`, the episodes the trainer records
    in rollouts/eval-step-NNNNNN.jsonl (the fields the intervals read, shaped as evaluation.py writes them)."""
    write_run(folder, {step: evaluation(sum(a for a in hits if a is not None) / sum(a is not None for a in hits), 1.0)
                       for step, hits in answers.items()})
    if record:
        os.makedirs(os.path.join(folder, "rollouts"))
        for step, hits in answers.items():
            with open(os.path.join(folder, "rollouts", f"eval-step-{step:06d}.jsonl"), "w") as f:
                for row, hit in enumerate(hits):
                    if hit is not None:
                        f.write(json.dumps({"step": step, "mode": "eval", "group": row, "sample": 0,
                                            "question": f"q{row}", "stop_reason": "answer", "tool_calls": [],
                                            "rewards": {"turn": {"exist_answer_in_search_results": 1.0},
                                                        "outcome": {"exact_match_reward_func": float(hit),
                                                                    "format_reward_func": 0.2}}}) + "\n")


def study_intervals(tmp_path, answers: dict[tuple[str, int], dict[int, list]], unrecorded=(), n=2000, seed=0):
    """The intervals of a study whose runs got `answers` ({(mode, seed): {step: hits}}); `unrecorded` runs
    recorded no episodes."""
    from learning_study import intervals, question_results

    runs = [(mode, run_seed, str(tmp_path / f"{mode}-s{run_seed}")) for mode, run_seed in answers]
    for (mode, run_seed, path), by_step in zip(runs, answers.values()):
        write_recorded_run(path, by_step, record=(mode, run_seed) not in unrecorded)
    results = {(mode, run_seed): question_results(path, "eval/exact_match") for mode, run_seed, path in runs}
    return {(r["name"], r["step"]): r for r in intervals(collect(runs), results, "eval/exact_match", n, seed)}


def test_the_two_level_bootstrap_gives_the_known_spread_at_each_level():
    import numpy as np
    from learning_study import two_level_bootstrap

    # one seed, half of 32 questions right: the resampled mean is binomial, 0.5 +- 1.96 * sqrt(0.25 / 32) = +-0.173
    low, high = np.percentile(two_level_bootstrap([np.array([1.0] * 16 + [0.0] * 16)], 4000), [2.5, 97.5])
    assert abs(low - 0.327) < 0.035 and abs(high - 0.673) < 0.035
    # two seeds at 0 and 1 with one value each (seeds only): the mean of two draws is 0, 0.5 or 1 (1/4, 1/2, 1/4)
    draws = two_level_bootstrap([np.array([0.0]), np.array([1.0])], 4000)
    assert set(draws) == {0.0, 0.5, 1.0} and abs((draws == 0.5).mean() - 0.5) < 0.03
    assert np.percentile(draws, 2.5) == 0.0 and np.percentile(draws, 97.5) == 1.0


def test_the_seed_level_test_by_hand():
    """Per-seed differences 0.1, 0.2, 0.3: mean 0.2, SD 0.1, t(0.975, 2) = 4.302653, so 0.2 +- 4.302653 * 0.1 /
    sqrt(3) = 0.2 +- 0.248414. Of the 8 sign vectors only all + (sum 0.6) and all - (-0.6) are as far from 0 as the
    observed sum; -0.1+0.2+0.3 = 0.4 is not: p = 2/8. Four equal seeds: SD 0, and p = 2/16, the least 4 seeds give."""
    from learning_study import seed_test, t_quantile

    assert [round(t_quantile(0.975, df), 4) for df in (1, 2, 4, 9)] == [12.7062, 4.3027, 2.7764, 2.2622]
    low, high, p = seed_test([0.1, 0.2, 0.3])
    assert math.isclose(low, 0.2 - 0.248414, abs_tol=1e-6) and math.isclose(high, 0.2 + 0.248414, abs_tol=1e-6)
    assert p == 0.25
    assert seed_test([0.05] * 4) == pytest.approx((0.05, 0.05, 0.125))
    # the audit: per_turn - outcome_only at step 30, seeds 11-15: p = 4/32 (-0.074 flipped is as far),
    # t-interval [-0.003, 0.340]: it includes 0 where the bootstrap's [0.040, 0.261] did not
    low, high, p = seed_test([0.274, 0.200, 0.211, 0.232, -0.074])
    assert p == 0.125 and (round(low, 3), round(high, 3)) == (-0.003, 0.341)
    assert seed_test([0.1, -0.1])[2] == 1.0 and all(math.isnan(v) for v in seed_test([0.3]))
    # past 16 seeds the signs are drawn: 24 equal seeds, none of 200,000 draws all one sign, p = 1 / 200,001
    assert seed_test([0.1] * 24)[2] == 1 / 200_001


def test_the_seeds_a_study_needs_for_its_effect():
    """The sized study's arithmetic (docs/results.md): at a seed SD of 0.111 the paired t-test finds a true 0.05 with
    80% power at 41 seeds and not at 40; by the normal approximation, (1.96 + 0.84)^2 * (0.111 / 0.05)^2 = 38.6, a
    lower bound at few seeds. The simulated power is that of a known case: with SD 0 any effect is found, and with no
    effect the test rejects 5% of the time (its size)."""
    from learning_study import seeds_needed, t_test_power

    assert t_test_power(41, 0.111) >= 0.8 > t_test_power(40, 0.111)
    assert seeds_needed(0.111) == 41 and seeds_needed(0.111 / 2) < 41 / 2 and seeds_needed(0.0) == 2
    assert seeds_needed(2.0) == 401  # a metric on another scale (calls per episode): past `most`, not simulated
    assert abs(t_test_power(10, 0.1, effect=0.0) - 0.05) < 0.006
    assert 0.11 < t_test_power(5, 0.111) < 0.14  # the study as run: 5 seeds had about 1 chance in 8


def test_identical_modes_differ_by_zero_and_a_better_mode_excludes_zero(tmp_path):
    """mt_grpo and merged get the same answers: difference 0, interval [0, 0]. outcome_only is wrong on 16 of the
    32 questions where mt_grpo is right, and never right where it is wrong: +0.5, its interval well above 0."""
    mixed = [1, 0] * 16  # 0.5
    answers = {}
    for seed in (1, 2):
        answers[("mt_grpo", seed)] = {0: [0] * 32, 10: mixed}
        answers[("merged", seed)] = {0: [0] * 32, 10: mixed}
        answers[("outcome_only", seed)] = {0: [0] * 32, 10: [0] * 32}
    table = study_intervals(tmp_path, answers)
    same = table[("mt_grpo - merged", "10")]
    assert (same["mean"], same["low"], same["high"]) == (0.0, 0.0, 0.0) and same["verdict"] == "interval includes 0"
    assert same["bootstrap"] == "seeds x questions" and same["seeds"] == "1/2" and same["questions"] == "32/32"
    assert same["plan"] == "planned" and (same["t_low"], same["t_high"], same["sign_flip_p"]) == (0.0, 0.0, 1.0)
    better = table[("mt_grpo - outcome_only", "10")]
    assert better["mean"] == 0.5 and 0.25 < better["low"] < 0.5 < better["high"] < 0.75
    # two seeds at +0.5 each: SD 0, the t-interval is the point; 2 of the 4 sign vectors are as far: p = 0.5
    assert (better["t_low"], better["t_high"], better["sign_flip_p"]) == (0.5, 0.5, 0.5)
    assert better["verdict"] == f"excludes 0 (lower bound {better['low']:.3f})"
    mode = table[("mt_grpo", "10")]
    assert mode["mean"] == 0.5 and mode["low"] < 0.5 < mode["high"] and mode["kind"] == "mode"
    assert ("per_turn - mt_grpo", "10") not in table  # per_turn did not run
    worse = study_intervals(tmp_path / "swapped", {("per_turn", 1): {10: [0] * 32}, ("mt_grpo", 1): {10: [1] * 32}})
    assert worse[("per_turn - mt_grpo", "10")]["verdict"] == "excludes 0 (upper bound -1.000)"


def test_an_outcome_reward_is_read_per_question_and_per_turn_pairs_with_outcome_only(tmp_path):
    """eval/rewards/outcome/<name> (a game's get_reward, say) is each episode's recorded value; a name the
    records lack gives no per-question results. per_turn - outcome_only is one of the differences."""
    from learning_study import question_results

    write_recorded_run(str(tmp_path / "run"), {10: [1, 0, None, 1]})
    assert question_results(str(tmp_path / "run"), "eval/rewards/outcome/format_reward_func") == {
        10: {0: 0.2, 1: 0.2, 3: 0.2}}
    assert question_results(str(tmp_path / "run"), "eval/rewards/outcome/exact_match_reward_func") == {
        10: {0: 1.0, 1: 0.0, 3: 1.0}}
    assert question_results(str(tmp_path / "run"), "eval/rewards/outcome/TextWorldQuest") == {}
    table = study_intervals(tmp_path / "study", {("per_turn", 1): {10: [1] * 32}, ("outcome_only", 1): {10: [0] * 32}})
    pair = table[("per_turn - outcome_only", "10")]
    assert pair["mean"] == 1.0 and pair["plan"] == "exploratory"  # not among the three the design planned
    assert math.isnan(pair["t_low"]) and math.isnan(pair["sign_flip_p"])  # one seed: no seed-level test


def test_a_question_one_mode_did_not_evaluate_is_dropped_from_the_pair(tmp_path):
    hits = [1] * 16 + [0] * 16
    without_last = hits[:-1] + [None]
    table = study_intervals(tmp_path, {("mt_grpo", 1): {10: hits}, ("merged", 1): {10: without_last},
                                       ("mt_grpo", 2): {10: hits}, ("merged", 2): {10: hits}})
    pair = table[("mt_grpo - merged", "10")]
    assert pair["dropped_questions"] == 1 and pair["questions"] == "31/32" and pair["mean"] == 0.0
    assert table[("merged", "10")]["questions"] == "31/32"  # a mode's own row keeps all its questions


def test_runs_without_recorded_episodes_fall_back_to_seeds_only(tmp_path):
    answers = {("mt_grpo", 1): {10: [1] * 8 + [0] * 24}, ("mt_grpo", 2): {10: [1] * 16 + [0] * 16},
               ("merged", 1): {10: [0] * 32}, ("merged", 2): {10: [0] * 32}}
    table = study_intervals(tmp_path, answers, unrecorded={("mt_grpo", 2)})
    mode, pair = table[("mt_grpo", "10")], table[("mt_grpo - merged", "10")]
    assert mode["bootstrap"] == pair["bootstrap"] == "seeds only" and mode["questions"] == ""
    # two seed means, 0.25 and 0.5: the draws' means lie between them
    assert mode["mean"] == 0.375 and (mode["low"], mode["high"]) == (0.25, 0.5)
    assert pair["verdict"] == "excludes 0 (lower bound 0.250), over 2 seeds only"
    assert table[("merged", "10")]["bootstrap"] == "seeds x questions"
    one_seed = study_intervals(tmp_path / "one", {("mt_grpo", 1): {10: [1] * 32}, ("merged", 1): {10: [0] * 32}},
                               unrecorded={("merged", 1)})
    pair = one_seed[("mt_grpo - merged", "10")]
    assert pair["mean"] == 1.0 and math.isnan(pair["low"]) and pair["verdict"].startswith("no interval")


def test_the_bootstrap_is_deterministic_for_its_seed(tmp_path):
    import numpy as np

    answers = {(mode, seed): {10: np.random.default_rng(10 * seed + len(mode)).integers(0, 2, 32).tolist()}
               for mode in ("mt_grpo", "merged") for seed in (1, 2, 3)}
    first = study_intervals(tmp_path / "a", answers)
    assert study_intervals(tmp_path / "b", answers) == first
    other = study_intervals(tmp_path / "c", answers, seed=1)
    assert other[("mt_grpo - merged", "10")]["low"] != first[("mt_grpo - merged", "10")]["low"]


def test_pairs_meet_at_each_shared_step_and_at_each_runs_budget_stop():
    from learning_study import evaluation_points

    a = {1: {0, 10, 26}, 2: {0, 10, 27}}
    b = {1: {0, 10, 25}, 2: {0, 10, 26}, 3: {0, 10, 30}}  # seed 3 has no mt_grpo run to pair with
    assert evaluation_points([a, b]) == [("0", [{1: 0, 2: 0}] * 2), ("10", [{1: 10, 2: 10}] * 2),
                                         ("last: 26/27 vs 25/26", [{1: 26, 2: 27}, {1: 25, 2: 26}])]
    assert [label for label, _ in evaluation_points([{1: {0, 10}, 2: {0, 10}}])] == ["0", "10"]


def test_report_only_writes_the_intervals_csv_and_trains_nothing(tmp_path, monkeypatch):
    """`--report-only` on existing run folders (a budget stop, not finished): OUT_intervals.csv with its columns;
    OUT.csv and OUT.png are not written."""
    import csv

    from learning_study import INTERVAL_COLUMNS, main

    for mode in ("mt_grpo", "merged"):
        write_recorded_run(str(tmp_path / "runs" / f"{mode}-s1"), {0: [0] * 4, 26: [1, 1, 0, int(mode == "mt_grpo")]})
    out = str(tmp_path / "study")
    monkeypatch.setattr(sys, "argv", ["learning_study.py", "--report-only", "--runs", str(tmp_path / "runs"),
                                      "--out", out, "--modes", "mt_grpo", "merged", "--seeds", "1", "2"])
    main()
    with open(out + "_intervals.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == INTERVAL_COLUMNS
    assert [(r["kind"], r["name"], r["step"]) for r in rows] == [
        ("mode", "mt_grpo", "0"), ("mode", "mt_grpo", "26"), ("mode", "merged", "0"), ("mode", "merged", "26"),
        ("difference", "mt_grpo - merged", "0"), ("difference", "mt_grpo - merged", "26")]
    assert rows[-1]["mean"] == "0.2500" and rows[-1]["questions"] == "4" and rows[-1]["metric"] == "eval/exact_match"
    assert not os.path.exists(out + ".csv") and not os.path.exists(out + ".png")


def test_the_study_asks_the_trainer_to_record_its_evaluations_unless_told_otherwise():
    """Each evaluation's episodes are the per-question results; a recipe's or the command line's own
    save_rollouts_steps wins."""
    from learning_study import command

    from mt_grpo_trainer import parse_args

    assert parse_args(command("mt_grpo", 1, "outputs/x", [])[2:])[0].save_rollouts_steps == 1_000_000
    told = command("mt_grpo", 1, "outputs/x", ["--save_rollouts_steps", "5"])
    assert parse_args(told[2:])[0].save_rollouts_steps == 5
    demo = os.path.join(ROOT, "hf_recipes", "SmolLM2-135M-Instruct", "cpu_demo.yaml")  # sets its own
    assert "--save_rollouts_steps" not in command("mt_grpo", 1, "outputs/x", [], recipe=demo)


def test_keep_copies_what_the_report_reads_and_checks_it(tmp_path):
    """`--keep DEST`: a finished run's trainer_state.json, its evaluation episodes without token arrays and prompt
    text, and its log with the machine's paths made relative; the kept folder gives the same per-question results,
    and records that do not give the logged mean are refused."""
    from learning_study import keep_record, question_results

    run = str(tmp_path / "runs" / "mt_grpo-s1")
    write_recorded_run(run, {0: [0, 1, 0, 0], 10: [1, 1, 0, 1]})
    for name in os.listdir(os.path.join(run, "rollouts")):  # the fields the trainer also records
        path = os.path.join(run, "rollouts", name)
        records = [json.loads(line) for line in open(path)]
        with open(path, "w") as f:
            f.writelines(json.dumps({**r, "tokens": [1, 2, 3], "prompt_text": "long"}) + "\n" for r in records)
    with open(os.path.join(run, "log.txt"), "w") as f:
        f.write(f"Run finished. Output folder: {os.path.abspath(run)}\nscript {ROOT}/mt_grpo_trainer.py\n")
    dest = str(tmp_path / "kept" / "mt_grpo-s1")
    assert keep_record(run, dest, "eval/exact_match") == 8
    assert question_results(dest, "eval/exact_match") == {0: {0: 0.0, 1: 1.0, 2: 0.0, 3: 0.0},
                                                          10: {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}}
    # every kept file is gzipped (a clone carries code more than records), and read as it is
    assert sorted(os.listdir(dest)) == ["log.txt.gz", "rollouts", "trainer_state.json.gz"]
    assert sorted(os.listdir(os.path.join(dest, "rollouts"))) == ["eval-step-000000.jsonl.gz", "eval-step-000010.jsonl.gz"]
    kept = [json.loads(line) for line in gzip.open(os.path.join(dest, "rollouts", "eval-step-000010.jsonl.gz"), "rt")]
    assert len(kept) == 4 and not any("tokens" in r or "prompt_text" in r for r in kept)
    log = gzip.open(os.path.join(dest, "log.txt.gz"), "rt").read()
    assert log == "Run finished. Output folder: <run>\nscript ./mt_grpo_trainer.py\n"
    state = gzip.open(os.path.join(dest, "trainer_state.json.gz"), "rt").read()
    assert state == open(os.path.join(run, "trainer_state.json")).read()
    # the same records kept again are the same bytes (no time stamp in the gzip header)
    again = str(tmp_path / "kept_again" / "mt_grpo-s1")
    keep_record(run, again, "eval/exact_match")
    for name in ("trainer_state.json.gz", "log.txt.gz", "rollouts/eval-step-000010.jsonl.gz"):
        assert open(os.path.join(dest, name), "rb").read() == open(os.path.join(again, name), "rb").read(), name
    # an evaluation whose records are not the logged one (a question lost): refused, not committed silently
    path = os.path.join(run, "rollouts", "eval-step-000010.jsonl")
    lines = open(path).readlines()
    with open(path, "w") as f:
        f.writelines(lines[:-1])
    with pytest.raises(SystemExit, match="do not give the logged eval/exact_match"):
        keep_record(run, str(tmp_path / "kept2" / "mt_grpo-s1"), "eval/exact_match")


def test_keep_takes_only_finished_runs_and_the_kept_folder_reports_alone(tmp_path, monkeypatch):
    """`--report-only --keep`: a run stopped early (15 of 30 steps) is reported but not kept; the finished one is,
    and the study command over the kept folder then trains nothing (the run counts as done) and reports it."""
    import learning_study
    from learning_study import main

    for mode, step in (("mt_grpo", 30), ("merged", 15)):
        path = str(tmp_path / "runs" / f"{mode}-s1")
        write_recorded_run(path, {0: [0, 1, 0, 0], step: [1, 1, 0, 1]})
        state = json.load(open(os.path.join(path, "trainer_state.json")))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({**state, "global_step": step, "max_steps": 30}, f)
    kept = tmp_path / "kept"
    monkeypatch.setattr(sys, "argv", ["learning_study.py", "--report-only", "--runs", str(tmp_path / "runs"), "--out",
                                      str(tmp_path / "study"), "--modes", "mt_grpo", "merged", "--seeds", "1",
                                      "--keep", str(kept)])
    main()
    assert sorted(os.listdir(kept)) == ["mt_grpo-s1"]
    monkeypatch.setattr(sys, "argv", ["learning_study.py", "--runs", str(kept), "--out", str(tmp_path / "again"),
                                      "--modes", "mt_grpo", "--seeds", "1"])
    monkeypatch.setattr(learning_study, "launch", lambda *a, **k: pytest.fail("a kept run was trained again"))
    main()
    assert [row["step"] for row in read_csv(str(tmp_path / "again.csv"))] == [0, 30]


# The committed studies of issue 41: (the name of OUT in studies/data/, its modes, its seeds). OUT.csv and
# OUT_intervals.csv must be what the kept records in OUT_runs/ give, so the numbers docs/results.md quotes from
# them can be redrawn by anyone, without training.
COMMITTED_STUDIES = [
    ("learning_study_entities", ("mt_grpo", "merged", "outcome_only", "per_turn"), (11, 12, 13, 14, 15)),
    ("learning_study_entities_gpu", ("mt_grpo", "merged"), (21, 22, 23)),
]


@pytest.mark.parametrize("name, modes, seeds", COMMITTED_STUDIES, ids=[s[0] for s in COMMITTED_STUDIES])
def test_a_committed_study_is_what_its_kept_records_give(name, modes, seeds, tmp_path):
    """Issue 41's protocol, checked on what is committed: every mode has every seed, all runs evaluated at the same
    steps on all 95 test questions, the seeds are fresh (in no other committed study, CSV or kept runs), and the CSV
    and the intervals (the same 2000-draw bootstrap) are rewritten from the kept records, byte for byte."""
    from learning_study import INTERVAL_COLUMNS, intervals, question_results, run_dir

    data = os.path.join(ROOT, "studies", "data")
    jobs = [(mode, seed, run_dir(os.path.join(data, name + "_runs"), mode, seed)) for seed in seeds for mode in modes]
    rows = collect(jobs)
    steps: dict[tuple[str, int], set[int]] = {}
    for r in rows:
        steps.setdefault((r["mode"], r["seed"]), set()).add(r["step"])
    assert set(steps) == {(m, s) for m in modes for s in seeds}
    assert set(map(frozenset, steps.values())) == {frozenset({0, 15, 30})}
    results = {(mode, seed): question_results(path, METRICS[0]) for mode, seed, path in jobs}
    assert all(sorted(map(len, r.values())) == [95, 95, 95] for r in results.values())
    earlier = set()  # the seeds of every other committed study: its CSV rows, or its kept runs' folders (<mode>-s<seed>)
    for entry in os.listdir(data):
        if entry.endswith(".csv") and not entry.startswith(name + ".") and not entry.startswith(name + "_"):
            with open(os.path.join(data, entry), newline="") as f:
                earlier |= {int(r["seed"]) for r in csv.DictReader(f) if r.get("seed")}
        elif entry.endswith("_runs") and entry != name + "_runs":
            earlier |= {int(run.rsplit("-s", 1)[1]) for run in os.listdir(os.path.join(data, entry)) if "-s" in run}
    assert {1, 2, 3} <= earlier and not earlier & set(seeds)  # 3: the pilot's seed (learning_study_entities_pilot_runs)

    write_csv(rows, str(tmp_path / "study.csv"))
    write_csv(intervals(rows, results, METRICS[0], 2000), str(tmp_path / "intervals.csv"), columns=INTERVAL_COLUMNS)
    for written, committed in (("study.csv", name + ".csv"), ("intervals.csv", name + "_intervals.csv")):
        with open(tmp_path / written) as again, open(os.path.join(data, committed)) as f:
            assert again.read() == f.read(), committed
