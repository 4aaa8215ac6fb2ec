"""Bad input fails at start-up with a message that names the field; a run stopped with SIGTERM
resumes from its checkpoint exactly where it stopped."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import RECIPE, ROOT, final_metrics, run
from mt_grpo_trainer import ADVANTAGE_MODES, MTGRPOConfig, MTGRPOScriptArguments, MultiTurnToolEnv, main
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.tasks import build_dataset


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(open(RECIPE).read() + text)
    return str(path)


CASES = [
    # (extra YAML, extra flags, exception, message)
    ("", ["--advantage_mode", "bogus"], ValueError, "`advantage_mode` is 'bogus'; choose one of"),
    ("", ["--weight_sync", "ftp"], ValueError, "`weight_sync` is 'ftp'"),
    ("", ["--turn_samples", "per_turn"], ValueError, "`turn_samples: per_turn` is now `turn_samples: per_model_turn`"),
    ("turn_samples: per_turn\n", [], ValueError, "`turn_samples: per_turn` is now `turn_samples: per_model_turn`"),
    ("", ["--answer_type", "number"], ValueError, "`answer_type` is 'number'; choose one of ['auto', 'text', 'math']"),
    ("", ["--turn_reward_weights", "1.0"], ValueError, "`turn_reward_weights` has 1 values but `turn_reward_funcs` has 2"),
    ("turn_reward_funcs: []\n", [], ValueError, "`advantage_mode: mt_grpo` credits turns, but the run has no turn reward"),
    ("", ["--per_device_train_batch_size", "6"], ValueError, "generation_batch_size (6) must be divisible by num_generations (4)"),
    ("", ["--max_tokens_per_turn", "500"], ValueError, "`max_tokens_per_turn` (500) exceeds `max_completion_length` (128)"),
    ("", ["--max_tool_response_tokens", "128"], ValueError, "`max_tool_response_tokens` (128) must be below"),
    ("", ["--use_vllm", "true"], ValueError, "set `use_vllm: false` and `generation_backend: vllm_server`"),
    ("", ["--tool_timeout", "0"], ValueError, "`tool_timeout` must be a positive number of seconds"),
    ("", ["--outcome_reward_funcs", "exact_match"], ValueError, "Unknown reward function 'exact_match'. Valid names:"),
    ("", ["--outcome_reward_funcs", "reward_examples:needs_gold"], ValueError,
     "Reward function 'needs_gold' needs the dataset column 'gold'"),
    ("", ["--tools", "calculator"], ValueError, "calculator"),
    ("", ["--dataset_name", "no/such/file.jsonl"], FileNotFoundError, "no/such/file.jsonl"),
    ("", ["--max_prompt_length", "5"], ValueError, "Every prompt is longer than `max_prompt_length` (5)"),
    ("bogus_key: 3\n", [], SystemExit, "bogus_key"),
    # issue 78, points 10-11: each field's type and least value, in one line; a misspelt key gets the nearest field
    ("max_user_turns: -1\n", [], ValueError, "`max_user_turns` takes an integer ≥ 0 or null; the config gave -1 (int)."),
    ("max_user_turns: 2.5\n", [], ValueError, "`max_user_turns` takes an integer ≥ 0 or null; the config gave 2.5"),
    ("max_user_turns: true\n", [], ValueError, "`max_user_turns` takes an integer ≥ 0 or null; the config gave True"),
    ("max_env_steps: 0\n", [], ValueError, "`max_env_steps` takes an integer ≥ 1 or null; the config gave 0 (int)."),
    ("tool_timeout: fast\n", [], SystemExit, "error: argument --tool_timeout: invalid float value: 'fast'. See"),
    ("few_shot: 2\n", [], ValueError, "`few_shot` takes true or false; the config gave 2 (int)."),
    ("max_user_turn: 2\n", [], SystemExit, "`max_user_turn`: did you mean `max_user_turns`?"),
    ("", ["--use_peft", "true", "--lora_dropout", "0", "--generation_backend", "vllm_server", "--lora_sync", "merged",
          "--weight_sync", "nccl"],
     ValueError, "`lora_sync: merged` goes through the disk sync"),
    ("", ["--lora_sync", "delta"], ValueError, "`lora_sync` is 'delta'; choose one of"),
    ("", ["--fp16", "true"], ValueError, "`fp16: true` (fp16 autocast with a loss scaler) needs a GPU"),
    ("", ["--fp16", "true", "--dtype", "float16"], ValueError, "Set `dtype: float32` (float32 master weights"),
    ("", ["--use_peft", "true", "--generation_backend", "vllm_server"], ValueError,
     "`lora_dropout` is 0.05 with an external sampler (VLLMServerClient)"),
    ("", ["--async_rollout", "true"], ValueError, "`async_rollout` overlaps a server's sampling with training"),
    ("", ["--dynamic_sampling", "true", "--dynamic_sampling_max_rounds", "0"], ValueError,
     "`dynamic_sampling_max_rounds` must be at least 1"),
    ("", ["--dynamic_sampling", "true", "--async_rollout", "true"], ValueError, "`dynamic_sampling` with `async_rollout`"),
    ("", ["--max_train_minutes", "0"], ValueError, "`max_train_minutes` must be > 0 (or unset for no limit), got 0.0"),
    ("", ["--max_tokens_per_microbatch", "0"], ValueError, "`max_tokens_per_microbatch` must be at least 1, or null"),
    ("", ["--rollout_scheduler", "per_episode"], ValueError, "`rollout_scheduler: per_episode` needs a server"),
    ("", ["--tool_format", "json"], ValueError, "`tool_format` is 'json'; choose one of"),
    ("", ["--metric_for_best_model", "reward"], ValueError, "`metric_for_best_model` is 'reward', which evaluation does not log"),
    ("", ["--load_best_model_at_end", "true", "--eval_strategy", "steps", "--save_strategy", "steps"], ValueError,
     "there is no eval loss"),
    ("", ["--mask_zero_advantage_groups", "true", "--loss_type", "unknown"], ValueError, "loss_type"),
    ("", ["--loss_type", "vespo", "--vllm_importance_sampling_mode", "sequence_mask"], ValueError,
     "`loss_type: vespo` folds token-level importance weights"),
    # several servers (server_pool.py): the one-server fields beside them, another backend, a bad URL or loss setting
    ("vllm_server_urls: [http://127.0.0.1:1, http://127.0.0.1:2]\n", ["--generation_backend", "vllm_server",
     "--vllm_server_port", "8001"], ValueError, "put every server in `vllm_server_urls` and remove `vllm_server_port`"),
    ("vllm_server_urls: [http://127.0.0.1:1, http://127.0.0.1:2]\n", ["--generation_backend", "transformers"],
     ValueError, "`vllm_server_urls` is set but `generation_backend` is 'transformers': set `generation_backend: "
                 "vllm_server`"),
    ("vllm_server_urls: [127.0.0.1:1, http://127.0.0.1:2]\n", ["--generation_backend", "vllm_server"], ValueError,
     "`vllm_server_urls` holds ['127.0.0.1:1']: give each server as http://HOST:PORT"),
    ("", ["--vllm_server_loss", "ignore"], ValueError, "`vllm_server_loss` is 'ignore'; choose one of ['retry', 'stop']"),
    # GRPOConfig fields this trainer replaces: each is refused with the name of ours
    # TRL's reward_weights weigh TRL's reward_funcs (here none); TRL's max_tool_calling_iterations is max_env_steps
    ("reward_weights: [1.0, 1.0, 1.0, 1.0, 1.0]\n", [], ValueError, "`reward_weights` has 5 values but `reward_funcs` has 0 functions"),
    # the advantage modes the message offers are the config's own choices (the table, then auto), never a list by hand
    ("multi_objective_aggregation: normalize_then_sum\n", [], ValueError, "`multi_objective_aggregation` ('normalize_then_sum') is not used "
     f"by this trainer: turn and outcome rewards are each summed and normalised per kind; choose `advantage_mode` ({', '.join([*ADVANTAGE_MODES, 'auto'])})."),
    ("max_tool_calling_iterations: 3\n", [], ValueError, "`max_env_steps` (2) and TRL's `max_tool_calling_iterations` (3) are one limit and disagree"),
    ("generation_kwargs: {no_repeat_ngram_size: 2}\n", [], ValueError, "`generation_kwargs` ({'no_repeat_ngram_size': 2}) is not used by this trainer: set the sampling fields"),
    ("vllm_mode: server\n", [], ValueError, "`vllm_mode` ('server') is not used by this trainer"),
    ("vllm_model_impl: transformers\n", [], ValueError, "`vllm_model_impl` ('transformers') is not used"),
    ("vllm_enable_sleep_mode: true\n", [], ValueError, "`vllm_enable_sleep_mode` (True) is not used"),
    ("vllm_gpu_memory_utilization: 0.5\n", [], ValueError, "launch.sh: VLLM_GPU_MEMORY"),
    ("vllm_tensor_parallel_size: 2\n", [], ValueError, "launch.sh: VLLM_TP"),
    ("vllm_max_model_length: 4096\n", [], ValueError, "launch.sh: VLLM_MAX_MODEL_LEN"),
    ("vllm_structured_outputs_regex: 'a+'\n", [], ValueError, "structured outputs are not supported"),
    ("vllm_group_port: 5000\n", [], ValueError, "`vllm_group_port` (5000) is not used by this trainer: set `nccl_master_port`"),
    ("use_transformers_continuous_batching: true\n", [], ValueError, "`use_transformers_continuous_batching` (True) is not used"),
    ("transformers_continuous_batching_config: {max_batch_tokens: 8}\n", [], ValueError, "`transformers_continuous_batching_config`"),
    # TRL maps its deprecated use_transformers_paged onto use_transformers_continuous_batching first
    ("use_transformers_paged: true\n", [], ValueError, "`use_transformers_continuous_batching` (True) is not used"),
]


@pytest.mark.parametrize("yaml_extra, flags, error, message", CASES)
def test_bad_config_fails_at_start_with_the_field_named(tmp_path, tiny_agent_dir, yaml_extra, flags, error, message):
    argv = ["--config", write(tmp_path, yaml_extra), "--model_name_or_path", tiny_agent_dir,
            "--output_dir", str(tmp_path / "out"), *flags]
    with pytest.raises(error) as info:
        main(argv)
    assert message in str(info.value)


def test_a_flag_of_the_wrong_type_is_one_line_not_the_whole_usage(tmp_path, tiny_agent_dir, capsys):
    """argparse's own error printed the usage of every field (about 300 lines) before the one that matters."""
    argv = ["--config", write(tmp_path, ""), "--model_name_or_path", tiny_agent_dir, "--max_user_turns", "abc"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert str(info.value) == ("mt_grpo_trainer.py: error: argument --max_user_turns: invalid int value: 'abc'. See "
                               "`python mt_grpo_trainer.py --help` for every field.")
    assert capsys.readouterr().err.count("\n") <= 1


def test_a_python_config_is_checked_as_a_recipe_is():
    """The API's MTGRPOScriptArguments / MTGRPOConfig check each field's type and least value at construction."""
    with pytest.raises(ValueError, match=r"`max_user_turns` takes an integer ≥ 0 or null; the config gave -1 \(int\)"):
        MTGRPOScriptArguments(max_user_turns=-1)
    with pytest.raises(ValueError, match=r"`tool_max_workers` takes an integer ≥ 1 or null; the config gave 2.0"):
        MTGRPOScriptArguments(tool_max_workers=2.0)
    assert MTGRPOScriptArguments(max_user_turns=0, tool_timeout=3).tool_timeout == 3  # an int where a float goes


def test_a_recipe_names_modules_of_the_folder_the_trainer_runs_in(tmp_path, tiny_agent_dir, monkeypatch):
    """`python ~/mt-grpo/mt_grpo_trainer.py --config recipe.yaml` from the user's folder: a dotted path to a module
    there resolves (Python put the repository on sys.path, not the current folder: ModuleNotFoundError)."""
    from mt_grpo.base.fields import parse_recipe
    from mt_grpo.rewards import get_reward_func

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_scores_78.py").write_text("def right(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(folder))])
    parse_recipe(["--config", write(tmp_path, ""), "--model_name_or_path", tiny_agent_dir], MTGRPOConfig)
    assert sys.path[-1] == str(folder)
    assert get_reward_func("my_scores_78:right")(completions=[[], []]) == [1.0, 1.0]
    # a data file, relative to that folder too
    (folder / "data").mkdir()
    (folder / "data" / "games.jsonl").write_text('{"question": "Guess my number.", "answer": "3"}\n')
    from mt_grpo.tasks import load_task

    assert load_task("data/games.jsonl").dataset["question"] == ["Guess my number."]


def test_missing_recipe_file_is_named():
    with pytest.raises(SystemExit, match="Recipe file not found: 'nope.yaml'"):
        main(["--config", "nope.yaml"])


def test_over_long_prompts_are_dropped_with_a_count(tiny_agent_dir, caplog):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=XMLProtocol(), tools=[], max_env_steps=2, max_tokens_per_turn=8,
                           max_completion_length=16, max_tool_response_tokens=8)
    task = type("Task", (), {"dataset": Dataset.from_dict({"question": ["short?", "long " * 400 + "?"], "answer": [["a"], ["b"]]})})
    limit = len(env.render_ids(env.prompt("short?"), add_generation_prompt=True)) + 10
    dataset = build_dataset(MTGRPOScriptArguments(max_prompt_length=limit), env, task)
    assert dataset["question"] == ["short?"]
    assert f"Dropped 1 of 2 prompts longer than max_prompt_length={limit}" in caplog.text


def test_sigterm_saves_a_checkpoint_and_resume_continues_exactly(tiny_agent_dir, tmp_path):
    flags = ["--config", RECIPE, "--model_name_or_path", tiny_agent_dir, "--max_steps", "4", "--save_strategy", "no"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # the reference: 4 steps in one go, beside the stopped run (each run is one thread)
    ref = str(tmp_path / "ref")
    reference_log = tmp_path / "reference.log"
    with open(reference_log, "w") as f:  # a file, not a pipe: nothing reads it until the stopped run is done
        reference_run = subprocess.Popen([sys.executable, "mt_grpo_trainer.py", *flags, "--output_dir", ref],
                                         cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    # stopped with SIGTERM after step 2 has been logged
    out = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "mt_grpo_trainer.py", *flags, "--output_dir", out], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step    2 |"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    assert reference_run.wait(timeout=300) == 0, reference_log.read_text()[-6000:]
    checkpoints = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    assert len(checkpoints) == 1
    stopped_at = int(checkpoints[0].split("-")[1])
    assert 2 <= stopped_at < 4
    # resumed: same steps, same learning rates, same final weights as the uninterrupted run
    run([sys.executable, "mt_grpo_trainer.py", *flags, "--output_dir", out, "--resume_from_checkpoint", "last",
         "--save_rollouts_steps", "1"], tmp_path)
    # it continued at the next step rather than starting over: it rolled out for those steps only
    recorded = sorted(os.listdir(os.path.join(out, "rollouts")))
    assert recorded == [f"step-{s:06d}.jsonl" for s in range(stopped_at + 1, 5)]
    resumed = {h["step"]: h for h in final_metrics(out) if "loss" in h}
    reference = {h["step"]: h for h in final_metrics(ref) if "loss" in h}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in range(stopped_at + 1, 5):
        assert resumed[step]["learning_rate"] == reference[step]["learning_rate"]
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], abs=1e-5)
    a, b = load_file(os.path.join(ref, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_time_budget_evaluates_saves_and_stops_at_the_step_that_passes_it(tiny_agent_dir, tmp_path):
    """`max_train_minutes`: the run stops after the first step past the budget, with an evaluation at that step,
    not only at step 0, and a checkpoint there. The budget reads a clock the test sets (run_trainer.py budget):
    1 minute, 30 s after step 1 and 90 s after step 2, so the run trains steps 1 and 2 on any machine."""
    out, clocks = str(tmp_path / "out"), tmp_path / "clocks.json"
    clocks.write_text(json.dumps([[0, 30, 90, 120, 150]]))
    run([sys.executable, "tests/run_trainer.py", "budget", str(clocks), "--config", RECIPE,
         "--model_name_or_path", tiny_agent_dir, "--max_steps", "4", "--save_strategy", "no", "--eval_strategy",
         "steps", "--eval_steps", "10", "--eval_max_samples", "2", "--max_train_minutes", "1", "--output_dir", out],
        tmp_path)
    history = final_metrics(out)
    trained = [h["step"] for h in history if "loss" in h]
    evaluated = [h["step"] for h in history if "eval/exact_match" in h]
    assert trained == [1, 2] and evaluated == [0, 2]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-2"]
