"""Run the trainer as a user does, in a subprocess, on a tiny random model: 2 optimizer steps.
Also the same on 2 CPU processes (torchrun, gloo), where ranks' episodes take different numbers of
turns. (`accelerate launch --cpu --num_processes 2` starts a single process: torchrun is the launcher
that really starts two.)"""

import json
import os

import pytest

from helpers import RECIPE, changed_parameters, final_metrics, launch, rollout_records, run, smoke_run


# the default (mt_grpo, no flags) is test_the_console_has_no_warning_of_ours's run
@pytest.mark.parametrize("mode, flags", [
    ("outcome_only", []),
    ("merged", ["--num_iterations", "2", "--beta", "0.02"]),  # old logprobs, the reference model and KL
    ("mt_grpo", ["--dynamic_sampling", "true"]),  # DAPO's dynamic sampling: empty groups rolled out again
    ("per_turn", ["--turn_reward_funcs", "tool_execution_per_turn", "answer_in_result_per_turn",
                  "repeated_query_penalty_per_turn", "--max_env_steps", "3", "--turn_credit_discount", "0.5",
                  "--kb_multi_hop", "0.3"]),
])
def test_two_steps_train_and_log_the_metrics(tiny_agent_dir, tmp_path, mode, flags):
    out, _, steps = smoke_run(tiny_agent_dir, tmp_path, "--advantage_mode", mode, *flags)
    check_two_steps(tiny_agent_dir, out, steps, mode, flags)


def check_two_steps(tiny_agent_dir, out, steps, mode, flags):
    """What every 2-step run of `mode` with `flags` logs, and that it trained."""
    assert len(steps) == 2
    # a rollout at every step, except that num_iterations 2 trains twice on each rollout
    rollout_steps = steps[::2] if "--num_iterations" in flags else steps
    turn_reward = "rewards/turn/tool_execution_per_turn" if mode == "per_turn" else "rewards/turn/tool_execution_reward_func"
    for key in ["rewards/turn/mean", "rewards/outcome/mean", turn_reward, "rewards/frac_zero_signal_groups",
                "rewards/outcome/exact_match_reward_func", "rollout/tool_calls_per_episode", "rollout/model_tokens",
                "completions/mean_length"]:
        assert all(key in h for h in rollout_steps), key
    assert all("clip_ratio/region_mean" in h for h in steps)
    if "--beta" in flags:
        assert all(h["kl"] >= 0 for h in steps)
    if "--dynamic_sampling" in flags:
        for h in steps:
            assert 0 <= h["dynamic_sampling/rounds"] <= 2 and h["dynamic_sampling/groups_replaced"] >= h["dynamic_sampling/rounds"]
            # the rounds stop early only when every group has signal
            assert h["dynamic_sampling/rounds"] == 2 or h["dynamic_sampling/groups_with_signal"] == 1.0, h
            # replacement only adds signal: the trained batch has no more empty groups than the policy's first draw
            assert h["rewards/frac_zero_signal_groups"] <= h["dynamic_sampling/first_draw/rewards/frac_zero_signal_groups"]
    assert changed_parameters(tiny_agent_dir, out), "no parameter changed after 2 optimizer steps"


def test_two_processes_train_and_stop_together_at_the_time_budget(tiny_agent_dir, tmp_path):
    """2 ranks, gloo: each rank's episodes end after different numbers of turns (random policy),
    and nothing may hang on a collective inside the rollout. `max_train_minutes` (one run for both): rank 0's
    clock decides, so both stop after the same step (a rank that went on alone would hang in the next
    collective) and the run exits 0 with one checkpoint. The clocks are the test's (run_trainer.py budget):
    rank 1's is past the 1-minute budget after step 1, rank 0's only after step 2, so both train 2 of 4 steps."""
    out, clocks = str(tmp_path / "out"), tmp_path / "clocks.json"
    clocks.write_text(json.dumps([[0, 30, 90, 120, 150], [0, 90, 120, 150, 180]]))
    run([*launch(2), "tests/run_trainer.py", "budget", str(clocks), "--config", RECIPE, "--model_name_or_path",
         tiny_agent_dir, "--output_dir", out, "--per_device_train_batch_size", "4", "--max_steps", "4",
         "--save_strategy", "no", "--max_train_minutes", "1", "--save_rollouts_steps", "1"], tmp_path)
    assert len(rollout_records(out)) == 8  # 4 episodes from each of the 2 processes
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2]
    assert [d for d in os.listdir(out) if d.startswith("checkpoint-")] == ["checkpoint-2"]
    # episodes ended after different numbers of turns (a mean that is not a whole number)
    assert any(h["rollout/turns_per_episode"] % 1 for h in steps), [h["rollout/turns_per_episode"] for h in steps]
    assert changed_parameters(tiny_agent_dir, out)


def test_the_console_has_no_warning_of_ours(tiny_agent_dir, tmp_path):
    r"""A run with greedy evaluation and the progress bars on, its output sent to a pipe as to a log file, prints
    one line per step, our INFO lines and the closing lines: no bar (a redraw's `\r`, a nested bar's cursor-up
    `\x1b[A`), and no warning that our code or recipe causes (transformers' generation-flag warning, TRL's
    gradient_checkpointing deprecation, dill's pickling warning, bm25s' DEBUG lines were all seen once). It is
    also the default mode's 2-step run (test_two_steps_train_and_log_the_metrics's checks)."""
    out, log, steps = smoke_run(tiny_agent_dir, tmp_path, "--eval_strategy", "steps", "--eval_steps", "1",
                                "--eval_max_samples", "4", "--disable_tqdm", "false")
    check_two_steps(tiny_agent_dir, out, steps, "mt_grpo", [])
    assert "step    1 |" in log  # StepPrinter's one line per step, after the line that says what comes
    assert log.index("Training 2 steps from step 0, ") < log.index("step    1 |")
    assert "\r" not in log and "\x1b[" not in log  # no bar of ours or of the libraries (quiet_library_bars)
    assert f"Run finished. Output folder: {out}\n  model: {out} " in log  # reporting.report_outputs
    noisy = [line for line in log.splitlines()
             if any(word in line for word in ("Warning", "warn(", "[transformers]", "DEBUG", "deprecated"))]
    assert not noisy, noisy
    assert "Setting accelerator to CPU" not in log  # DeepSpeed's, on every CPU run (mt_grpo/__init__.py drops it)
