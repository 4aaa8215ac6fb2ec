"""The Python API, as a TRL user writes it: the README's example runs (a function tool, a `datasets.Dataset`),
and tasks the recipe loads from a local file with TRL's `prompt` column or through `load_dataset` from a folder
laid out as the hub returns one both train."""

import json
import os
import re
import sys

import datasets
import pytest

from helpers import RECIPE, ROOT, final_metrics, rollout_records, run

TINY_FLAGS = ["--max_steps", "1", "--save_strategy", "no", "--save_rollouts_steps", "1", "--max_samples", "8",
              "--per_device_train_batch_size", "4", "--eval_strategy", "no"]
KB_WORDS = ("Veltria", "Morvane", "Brenloom", "Tessa", "capital", "look things up")


def system_and_user(record: dict) -> tuple[str, str]:
    """The system message and the last user turn of a recorded prompt (ChatML, as the tiny models render it)."""
    turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", record["prompt_text"], re.S)
    return turns[0][1], [text for role, text in turns if role == "user"][-1]


def readme_example() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Your own task in Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_trains(tiny_agent_dir, tmp_path):
    """The example as written, with the tiny model in place of SmolLM2 and its output in a temp folder."""
    code, out = readme_example(), str(tmp_path / "multiply")
    for old, new in [('"models/SmolLM2-135M-Instruct"', repr(tiny_agent_dir)), ('"outputs/multiply"', repr(out))]:
        assert old in code, f"the README example no longer holds {old}"
        code = code.replace(old, new)
    run([sys.executable, "-c", code], tmp_path)  # from the repository root, as the README says
    assert sorted(os.listdir(os.path.join(out, "rollouts"))) == ["step-000001.jsonl", "step-000002.jsonl"]
    records = rollout_records(out)
    assert len(records) == 8
    system, _ = system_and_user(records[0])
    assert "multiply" in system and not any(w in system for w in KB_WORDS), system
    assert "    a: The first number." in system  # the argument's description, from the docstring
    # the worked examples as turns, then the question; TRL's reward by its name, ours for the turn
    assert '<tool>{"name": "multiply", "args": {"a": 213, "b": 19}}</tool>' in records[0]["prompt_text"]
    assert all(set(r["rewards"]) == {"turn", "outcome"} and set(r["rewards"]["outcome"]) == {"correct"}
               and set(r["rewards"]["turn"]) == {"tool_execution_reward_func"} for r in records)
    # the tiny model never writes the product nor calls multiply: no signal, so no update to check here; the README
    # gives SmolLM2's run (calls in most episodes, a non-zero loss)
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    # trainer_state.json, which scripts/plot_runs.py reads, though the example saves no checkpoint (issue 78, 15)
    with open(os.path.join(out, "trainer_state.json")) as f:
        assert [h["step"] for h in json.load(f)["log_history"] if "loss" in h] == [1, 2]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def train(tiny_agent_dir, tmp_path, *flags) -> str:
    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", tiny_agent_dir,
         "--output_dir", out, *TINY_FLAGS, *flags], tmp_path)
    assert len([h for h in final_metrics(out) if "loss" in h]) == 1
    return out


def test_a_local_file_with_trl_prompts_trains(tiny_agent_dir, tmp_path):
    """Conversational `prompt` rows (TRL's format) with the answer under another name: the prompt's own system
    message is the task part, the tool format follows, and the questions are the prompts' user turns."""
    rows = [{"prompt": [{"role": "system", "content": "You are a careful archivist."},
                        {"role": "user", "content": f"Which year is on shelf {i}?"}],
             "gold": str(1700 + i)} for i in range(8)]
    out = train(tiny_agent_dir, tmp_path, "--dataset_name", write_jsonl(tmp_path / "shelves.jsonl", rows),
                "--answer_column", "gold", "--tools", "tests.tool_examples:search")
    record = rollout_records(out)[0]
    system, question = system_and_user(record)
    assert system.startswith("You are a careful archivist.") and "<tool>" in system
    assert re.fullmatch(r"Which year is on shelf \d\?", question)


def test_a_hub_layout_folder_trains_through_load_dataset(tiny_agent_dir, tmp_path):
    """A folder as the hub returns a dataset (data/<split>-*.parquet), named by its path: datasets.load_dataset
    reads it, the split picks the file, and standard (text) prompts become the user turn."""
    folder = tmp_path / "arith"
    (folder / "data").mkdir(parents=True)
    for split, n in (("train", 8), ("test", 4)):
        datasets.Dataset.from_list([{"problem": f"What is {i} plus {i}?", "solution": str(2 * i)} for i in range(n)]
                                   ).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    out = train(tiny_agent_dir, tmp_path, "--dataset_name", str(folder), "--question_column", "problem",
                "--answer_column", "solution", "--tools", "tests.tool_examples:search")
    prompts = [system_and_user(r)[1] for r in rollout_records(out)]
    assert all(re.fullmatch(r"What is \d plus \d\?", p) for p in prompts), prompts


def strict_reward(prompts, completions):
    return [0.0 for _ in completions]


@pytest.mark.parametrize("bad, message", [
    (dict(train_dataset=[{"question": "q", "answer": "a"}]), "pass a datasets.Dataset"),
    (dict(tools=["no_such_tool"]), "Unknown tool 'no_such_tool'"),
    (dict(outcome_reward_funcs=["no_such_reward"]), "Unknown reward function 'no_such_reward'"),
    # TRL's signature ends in **kwargs: one without is refused at start-up, not after the first rollout
    (dict(reward_funcs=strict_reward), "Reward function 'strict_reward' takes no `**kwargs`, but every reward receives "
                                       "the dataset's columns and TRL's keywords as keyword arguments, and it would "
                                       "be passed ['question', 'answer', 'answer_aliases', 'completion_ids', "
                                       "'trainer_state', 'log_extra', 'log_metric', 'stop_reason']"),
    # a list in the config and another to the trainer: neither silently wins
    (dict(turn_reward_funcs=["tool_execution_reward_func"], config=dict(turn_reward_funcs=["answer_in_tool_result"])),
     "`turn_reward_funcs` is given twice: to MTGRPOEnvTrainer(...) (['tool_execution_reward_func']) and in the "
     "config (['answer_in_tool_result'])"),
])
def test_api_errors_name_the_problem(tiny_agent_dir, tmp_path, bad, message):
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    data = datasets.Dataset.from_list([{"question": "What is 2 plus 2?", "answer": "4"}] * 4)
    bad = dict(bad)
    kwargs = dict(train_dataset=data, tools=[tool_examples_search()]) | bad
    config = kwargs.pop("config", {})
    args = MTGRPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, use_cpu=True,
                        bf16=False, report_to="none", max_completion_length=64, max_tokens_per_turn=32,
                        max_tool_response_tokens=32, **config)
    with pytest.raises(ValueError, match=re.escape(message)):
        MTGRPOEnvTrainer(model=tiny_agent_dir, args=args, **kwargs)


def tool_examples_search():
    from tool_examples import search

    return search


def guide_files() -> dict[str, str]:
    """The files of docs/guide.md's "Adding a task" and "Adding a tool": each code block that opens with a comment
    naming its path under my_task/."""
    with open(os.path.join(ROOT, "docs", "guide.md")) as f:
        text = f.read()
    blocks = re.findall(r"```(?:python|yaml)\n# (my_task/[\w.]+)[^\n]*\n(.*?)```", text, re.S)
    return {path: body for path, body in blocks}


def test_the_guides_task_and_tool_train_as_written(tiny_agent_dir, tmp_path, monkeypatch):
    """The guide's three files in a folder my_task/ (here under a temp folder, put on the path as the repository
    root is), with the tiny model: the data script writes 30 questions, the calculator computes, and the recipe
    trains one step whose prompt is the task's, not the knowledge base's; the viewer draws it."""
    import subprocess

    files = guide_files()
    assert sorted(files) == ["my_task/calculator.py", "my_task/make_data.py", "my_task/recipe.yaml"]
    (tmp_path / "my_task").mkdir()
    out = str(tmp_path / "arith")
    recipe = files["my_task/recipe.yaml"]
    for old, new in [("models/SmolLM2-135M-Instruct", tiny_agent_dir), ("outputs/arith", out),
                     ("my_task/arith.jsonl", str(tmp_path / "my_task" / "arith.jsonl"))]:
        assert old in recipe
        recipe = recipe.replace(old, new)
    (tmp_path / "my_task" / "recipe.yaml").write_text(recipe)
    for name in ("make_data.py", "calculator.py"):
        (tmp_path / "my_task" / name).write_text(files[f"my_task/{name}"])
    subprocess.run([sys.executable, "my_task/make_data.py"], cwd=tmp_path, check=True)
    rows = [json.loads(line) for line in open(tmp_path / "my_task" / "arith.jsonl")]
    assert len(rows) == 30 and all(set(r) == {"question", "answer"} for r in rows)

    monkeypatch.syspath_prepend(str(tmp_path))
    from my_task.calculator import calculator

    assert calculator("24 * 17") == "408" and calculator("(3 + 4) / 2") == "3.5" and calculator("-2 * 3") == "-6"
    with pytest.raises(ValueError, match="only numbers"):
        calculator("__import__('os').getcwd()")

    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run([sys.executable, "mt_grpo_trainer.py", "--config", str(tmp_path / "my_task" / "recipe.yaml"),
         "--max_steps", "1", "--per_device_train_batch_size", "4"], tmp_path)
    record = rollout_records(out)[0]
    system, _ = system_and_user(record)
    assert system.startswith("You solve arithmetic word problems.") and "calculator" in system
    assert not any(w in record["prompt_text"] for w in KB_WORDS)
    assert "A box holds 12 pens. How many pens are in 9 boxes?" in record["prompt_text"]  # the worked example
    run([sys.executable, "scripts/view_rollouts.py", out], tmp_path)
    assert "calculator" in open(os.path.join(out, "rollouts.html")).read()


def test_a_mistyped_model_folder_is_named_before_the_hub_is_tried(tmp_path, monkeypatch):
    """`models/SmolLM2` has a hub id's shape: transformers would try the hub (a minute of retries offline) and
    never name the folder. A path under an existing folder is taken as local, and its neighbours are listed."""
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    (tmp_path / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    args = MTGRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2,
                        use_cpu=True, bf16=False, report_to="none")
    data = datasets.Dataset.from_list([{"question": "What is 2 plus 2?", "answer": "4"}] * 2)
    with pytest.raises(OSError) as info:
        MTGRPOEnvTrainer(model="models/SmolLM2", args=args, train_dataset=data, tools=[tool_examples_search()])
    assert str(info.value).startswith(f"Model 'models/SmolLM2' is not a local folder (no {tmp_path}/models/SmolLM2). "
                                      "Fix the path (models holds ['SmolLM2-135M-Instruct'])")


SHOW_LOG_SCRIPT = """
import logging, sys
sys.path.insert(0, sys.argv[3])  # this checkout's modules, not another install's
import datasets
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
args = MTGRPOConfig(output_dir=sys.argv[2], num_generations=2, per_device_train_batch_size=2, use_cpu=True, bf16=False,
                    report_to="none", max_completion_length=32)
data = datasets.Dataset.from_list([{"question": "What is 2 plus 2?", "answer": "4"}] * 2)
trainer = MTGRPOEnvTrainer(model=sys.argv[1], args=args, train_dataset=data, reward_funcs="exact_match_reward_func")
log = logging.getLogger("mt_grpo")
print("RESULT", trainer.advantage_mode, len(log.handlers), logging.getLevelName(log.getEffectiveLevel()))
"""


def test_a_python_script_sees_the_trainers_choices_as_a_recipe_run_does(tiny_agent_dir, tmp_path):
    """A script that set up no logging gets the trainer's INFO lines (Python alone shows warnings only), so it reads
    which mode `advantage_mode: auto` chose and how to add turn credit; a program with its own logging (here pytest,
    whose handlers sit on the root logger) keeps it."""
    import logging

    from mt_grpo.run.reporting import show_log

    show_log()
    assert logging.getLogger().handlers and logging.getLogger("mt_grpo").handlers == []
    (tmp_path / "script.py").write_text(SHOW_LOG_SCRIPT)
    log = run([sys.executable, str(tmp_path / "script.py"), tiny_agent_dir, str(tmp_path / "out"), ROOT], tmp_path)
    assert "RESULT outcome_only 1 INFO" in log
    assert "advantage_mode auto: outcome_only (TRL's GRPO): the run has no turn reward" in log
