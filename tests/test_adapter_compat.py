"""mt_grpo/compat: a user's environment written for verl, verifiers or OpenEnv runs on a machine without that
framework, with nothing on its path but the environment's own folder. Held-out environments (not the canonical
examples of tests/fixtures), one per framework, written into a temporary folder in each framework's style, roll out
from their recipe field with a scripted policy in a fresh process whose PYTHONPATH is that folder and the repository
only; the verl one also trains a step from the command line. An installed framework wins over the copy, a broken one
does not; the copies ship with their licenses."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, final_metrics, rollout_records

COMPAT = os.path.join(ROOT, "mt_grpo", "compat")

# -- the held-out environments, as a user writes them ---------------------------------------------------------------
VERL_ENV = '''
"""Count a word in a text (verl 0.7.1 style): a BaseTool whose instance gets the row's text from tools_kwargs'
create_kwargs and rewards each lookup that finds the word, a BaseInteraction that checks the answer as the user,
and a compute_score on verl's GSM8K parser."""
from typing import Any, Optional
from uuid import uuid4

from verl.interactions.base import BaseInteraction
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score import gsm8k


class WordCountTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"text": kwargs.get("create_kwargs", {})["text"]}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        word = str(parameters.get("word", "")).lower()
        count = self._instance_dict[instance_id]["text"].lower().split().count(word)
        return ToolResponse(text=f"{word}: {count}"), (0.1 if count else -0.1), {"count": count}

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)


class CountCheckInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        content = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
        truth = self._instance_dict[instance_id]["ground_truth"]
        if gsm8k.compute_score(content, truth, method="flexible") == 1.0:
            return True, "Right.", 1.0, {}
        return False, "Count again.", 0.0, {}

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return gsm8k.compute_score(solution_str, ground_truth)
'''

VERL_TOOLS = '''
tools:
  - class_name: wordcount_verl.WordCountTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: count_word
        description: How many times a word appears in the text.
        parameters:
          type: object
          properties:
            word:
              type: string
              description: The word to count.
          required: [word]
'''

VERL_INTERACTION = '''
interaction:
  - name: count
    class_name: wordcount_verl.CountCheckInteraction
    config: {}
'''

VERIFIERS_ENV = '''
"""Reverse a word (classic verifiers style): a MultiTurnEnv whose env_response tells the model to try again, a
@vf.stop condition when the answer is right, a rubric of correctness and format."""
from datasets import Dataset

import verifiers as vf


class ReverseEnv(vf.MultiTurnEnv):
    async def setup_state(self, state: vf.State) -> None:
        state["tries"] = 0

    @vf.stop
    async def reversed_right(self, state: vf.State) -> bool:
        return bool(state["trajectory"]) and self.parser.parse_answer(state["completion"]) == state["answer"]

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        state["tries"] += 1
        return [{"role": "user", "content": f"Not quite ({state['tries']}). Reverse it letter by letter."}]


def load_environment(**kwargs) -> vf.Environment:
    words = ["stressed", "drawer"]
    dataset = Dataset.from_list([{"question": f"Reverse the word {w!r}.", "answer": w[::-1]} for w in words])
    parser = vf.XMLParser(fields=["answer"], answer_field="answer")

    def exact(parser, completion, answer, **kwargs) -> float:
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    rubric = vf.Rubric(funcs=[exact], weights=[1.0], parser=parser)
    return ReverseEnv(dataset=dataset, system_prompt="Answer inside <answer>...</answer>.", parser=parser,
                      rubric=rubric, max_turns=3, **kwargs)
'''

OPENENV_ENV = '''
"""Reach a target sum (OpenEnv style): an AddAction, an Observation with the running total, reward 1 and done on
the target, -1 and done past it, -0.1 otherwise."""
from typing import Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class AddAction(Action):
    """Add a number to the running total."""

    amount: int


class SumObservation(Observation):
    total: int
    target: int


class TargetSumEnvironment(Environment):
    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._total, self._target = 0, 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, target: int = 10,
              **kwargs) -> SumObservation:
        self._total, self._target = 0, int(target)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SumObservation(total=0, target=self._target)

    def step(self, action: AddAction, timeout_s: Optional[float] = None, **kwargs) -> SumObservation:
        self._state.step_count += 1
        self._total += action.amount
        if self._total == self._target:
            return SumObservation(total=self._total, target=self._target, done=True, reward=1.0)
        over = self._total > self._target
        return SumObservation(total=self._total, target=self._target, done=over, reward=-1.0 if over else -0.1)

    @property
    def state(self) -> State:
        return self._state
'''

# -- the rollouts, in a fresh process that sees only the environments' folder and the repository ----------------------
ROLLOUTS = '''
import json, os, sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join({root!r}, "tests"))  # the scripted policy and make_env (not a framework)
from transformers import AutoTokenizer

from mt_grpo.rollout.environments import EnvironmentPool
from helpers import make_env
from mt_grpo.base.protocol import XMLProtocol
from mt_grpo.adapters import resolve_reward  # the run's reward lookup (builders.py)
from scripted_policy import ScriptedPolicy

tokenizer = AutoTokenizer.from_pretrained({tokenizer!r})


def call(tool, **args):
    return "<reasoning>Check.</reasoning>\\n<tool>" + json.dumps({{"name": tool, "args": args}}) + "</tool>"


def answer(text):
    return f"<reasoning>So.</reasoning>\\n<answer>{{text}}</answer>"


def roll(value, rows, script, **limits):
    from mt_grpo import adapters
    blank = {{name: None for name in ("verl_tool_config", "verl_interaction_config", "multi_turn_scheduler",
                                     "verifiers_env", "verifiers_env_args", "openenv_env", "openenv_action")}}
    parts, = adapters.adapt(SimpleNamespace(**{{**blank, **value, "tool_timeout": 10.0}}))
    pool = EnvironmentPool(parts.environment_factory, [], XMLProtocol())
    env = make_env(tokenizer, pool.all_tools(), environments=pool, task_prompt=None, examples=None,
                   max_completion_length=800, max_tokens_per_turn=96, **{{**parts.settings, **limits}})
    rows = rows if rows is not None else [dict(r) for r in parts.train_dataset]
    eps = env.rollout([env.prompt(r["prompt"]) for r in rows], ScriptedPolicy(tokenizer, script), rows=rows)
    completions, instances = [ep.messages for ep in eps], [ep.toolset.environment for ep in eps]
    steps = pool.reward_funcs[1][0](completions=completions, environments=instances)
    outcome = {{f.__name__: f(prompts=[None] * len(eps), completions=completions, environments=instances)
               for f in parts.outcome_funcs}}
    return {{"messages": completions, "stop": [ep.stop_reason for ep in eps], "steps": steps, "outcome": outcome,
            "tools": sorted(t.__name__ for t in pool.all_tools()), "rows": rows}}


# a reward by dotted path whose module imports verl, resolved before any adapter ran (no adapter field is set)
score = resolve_reward("wordcount_verl.compute_score")
out = {{}}
text = "the cat saw the cat and a dog"
row = {{"prompt": [{{"role": "user", "content": "How often does 'cat' appear in the text? End with #### N."}}],
        "data_source": "wordcount", "reward_model": {{"ground_truth": "2"}},
        "extra_info": {{"tools_kwargs": {{"count_word": {{"create_kwargs": {{"text": text}}}}}},
                       "interaction_kwargs": {{"name": "count", "ground_truth": "2"}}}}}}
out["verl"] = roll({{"verl_tool_config": "tools.yaml", "verl_interaction_config": "interaction.yaml"}},
                   [row], {{"How often does 'cat'": [call("count_word", word="dog"), answer("#### 1"),
                                                    call("count_word", word="cat"), answer("#### 2")]}},
                   max_env_steps=4, max_user_turns=3)
out["verl"]["compute_score"] = score(completions=out["verl"]["messages"], data_source=["wordcount"],
                                     reward_model=[{{"ground_truth": "2"}}], extra_info=[row["extra_info"]])
out["verifiers"] = roll({{"verifiers_env": "reverse_vf"}}, None,
                        {{"Reverse the word 'stressed'": [answer("desserts")],
                          "Reverse the word 'drawer'": [answer("rewrad"), answer("reward")]}})
out["openenv"] = roll({{"openenv_env": "target_sum:TargetSumEnvironment"}},
                      [{{"prompt": [{{"role": "user", "content": "Reach the target with additions."}}], "target": 7}}],
                      {{"Reach the target": [call("add", amount=5), call("add", amount=1), call("add", amount=1)]}},
                      max_env_steps=5)
out["modules"] = {{name: sys.modules[name].__file__ for name in ("verl", "verifiers", "openenv")}}
print("RESULT " + json.dumps(out, default=str))
'''


def clean_env(folder) -> dict:
    """This process's environment with PYTHONPATH = the user's folder and the repository, nothing else."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(folder), ROOT]), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def user_folder(tmp_path):
    """The held-out environments in a folder of their own, as a user keeps them."""
    folder = tmp_path / "user"
    folder.mkdir()
    for name, text in {"wordcount_verl.py": VERL_ENV, "tools.yaml": VERL_TOOLS, "interaction.yaml": VERL_INTERACTION,
                       "reverse_vf.py": VERIFIERS_ENV, "target_sum.py": OPENENV_ENV}.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    return folder


def test_held_out_environments_of_each_framework_roll_out_without_the_framework(user_folder, tiny_model_dir):
    """verl: the tool's create_kwargs come from the row, each lookup's step reward is its turn's R_T and the
    interaction's score the answered turn's; verifiers: env_response is the user and the rubric scores; OpenEnv:
    the Action is the tool, each observation's reward its turn's R_T, `done` ends the episode. All three
    frameworks resolve to the copies in mt_grpo/compat."""
    script = ROLLOUTS.format(root=ROOT, tokenizer=tiny_model_dir)
    proc = subprocess.run([sys.executable, "-c", script], cwd=user_folder, env=clean_env(user_folder),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert all(path.startswith(COMPAT + os.sep) for path in out["modules"].values()), out["modules"]
    for framework in ("verl", "verifiers", "openenv"):  # logged once each (verifiers 0.4 is installed, not classic)
        assert proc.stderr.count(f": using the copy of {framework} ") == 1, proc.stderr

    verl = out["verl"]
    assert verl["tools"] == ["count_word"] and verl["stop"] == ["env_done"]
    messages = verl["messages"][0]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["dog: 1", "cat: 2"]  # the row's text
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Count again.", "Right."]
    # R_T per answered turn: the lookups' step rewards (0.1 each: the word was found), the interaction's scores
    assert verl["steps"] == [[pytest.approx(0.1), 0.0, pytest.approx(0.1), 1.0]]
    assert verl["compute_score"] == [1.0]  # verl's strict GSM8K parse of the last "#### 2"

    vf = out["verifiers"]
    assert vf["stop"] == ["answer", "answer"], vf
    assert [m["content"] for m in vf["messages"][1] if m["role"] == "user"] == ["Not quite (1). Reverse it letter by "
                                                                               "letter."]
    assert vf["outcome"] == {"exact": [1.0, 1.0]}
    assert vf["steps"] == [[], [None]]  # the reply has no score: not applicable (left out of the group)

    oe = out["openenv"]
    assert oe["tools"] == ["add"] and oe["stop"] == ["env_done"]
    assert [m["content"] for m in oe["messages"][0] if m["role"] == "tool"] == \
        ["total: 5\ntarget: 7", "total: 6\ntarget: 7", "total: 7\ntarget: 7"]
    assert oe["steps"] == [[pytest.approx(-0.1), pytest.approx(-0.1), 1.0]]


RECIPE = """
model_name_or_path: {model}
dtype: float32
dataset_name: {data}
verl_tool_config: tools.yaml
verl_interaction_config: interaction.yaml
outcome_reward_funcs: [wordcount_verl.compute_score]
max_env_steps: 2
max_user_turns: 1
max_prompt_length: 512
max_completion_length: 96
max_tokens_per_turn: 24
max_tool_response_tokens: 16
generation_backend: transformers
num_generations: 2
per_device_train_batch_size: 2
max_steps: 1
learning_rate: 1.0e-3
use_cpu: true
bf16: false
output_dir: {out}
save_strategy: "no"
save_rollouts_steps: 1
logging_steps: 1
report_to: none
disable_tqdm: true
eval_strategy: "no"
seed: 0
"""


def test_a_held_out_verl_environment_trains_a_step_from_the_command_line(user_folder, tiny_agent_dir, tmp_path):
    """`python mt_grpo_trainer.py --config recipe.yaml` from the user's folder, PYTHONPATH = that folder and the
    repository: verl's YAMLs, a parquet of verl rows and the module's compute_score by dotted path."""
    from datasets import Dataset

    row = {"prompt": [{"role": "user", "content": "How often does 'cat' appear? End with #### N."}],
           "data_source": "wordcount", "reward_model": {"style": "rule", "ground_truth": "2"},
           "extra_info": {"tools_kwargs": {"count_word": {"create_kwargs": {"text": "the cat saw the cat"}}},
                          "interaction_kwargs": {"name": "count", "ground_truth": "2"}}}
    data = str(user_folder / "train.parquet")
    Dataset.from_list([row, row]).to_parquet(data)
    out = str(tmp_path / "out")
    (user_folder / "recipe.yaml").write_text(RECIPE.format(model=tiny_agent_dir, data=data, out=out))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "mt_grpo_trainer.py"), "--config", "recipe.yaml"],
                          cwd=user_folder, env=clean_env(user_folder), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "verl is not installed: using the copy of verl 0.7.1's base classes in mt_grpo/compat" in proc.stderr
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 1 and "rewards/outcome/compute_score" in steps[0], steps
    assert "rewards/turn/VerlEnvironment_steps" in steps[0]
    records = rollout_records(out)
    assert len(records) == 2 and all("How often does 'cat' appear?" in r["prompt_text"] for r in records)


# -- which one is imported ------------------------------------------------------------------------------------------
PROBE = """
import logging
logging.basicConfig(level=logging.WARNING)
from mt_grpo.compat import provide
copy = provide("verl")
import verl.tools.base_tool
print(copy, verl.tools.base_tool.__file__)
"""


def test_an_installed_framework_wins_and_a_broken_one_gives_way_to_the_copy(tmp_path):
    """A `verl` on the path whose modules import is used as is; one whose import fails (verl's own needs ray) is
    dropped, whole, for the copy, and the log says why. A scorer the copy lacks fails naming it."""
    site = tmp_path / "site"
    for module in ("tools/base_tool", "tools/schemas", "interactions/base", "utils/reward_score/__init__"):
        path = site / "verl" / f"{module}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (site / "verl" / "__init__.py").write_text("")
    env = clean_env(site)
    installed = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.split() == ["False", str(site / "verl" / "tools" / "base_tool.py")]
    assert "mt_grpo/compat" not in installed.stderr

    (site / "verl" / "utils" / "reward_score" / "__init__.py").write_text("import ray  # noqa\n")
    broken = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.split() == ["True", os.path.join(COMPAT, "verl", "verl", "tools", "base_tool.py")]
    assert "verl is installed but does not import here (ModuleNotFoundError: No module named 'ray')" in broken.stderr

    lacks = ("from mt_grpo.compat import provide; provide('verl')\n"
             "from verl.utils.reward_score import default_compute_score\n"
             "print(default_compute_score('openai/gsm8k', '#### 3', '3'))\n"
             "default_compute_score('numina_olympiads', '3', '3')")  # prime_math: not in the copy
    run = subprocess.run([sys.executable, "-c", lacks], cwd=tmp_path, env=clean_env(tmp_path), capture_output=True,
                         text=True)
    assert run.stdout.split() == ["1.0"]
    assert "cannot import name 'prime_math' from 'verl.utils.reward_score'" in run.stderr, run.stderr


def test_the_copies_ship_with_their_licenses_and_provenance():
    """Each framework's folder has its LICENSE; each copied file names its license (the wheel's header, or one
    pointing at that LICENSE); the README says what is copied from which version."""
    headers = {"verl": "Licensed under the Apache License, Version 2.0", "verifiers": "MIT License",
               "openenv": "SPDX-License-Identifier: BSD-3-Clause"}
    readme = open(os.path.join(COMPAT, "README.md")).read()
    for framework, header in headers.items():
        assert os.path.isfile(os.path.join(COMPAT, framework, "LICENSE"))
        files = glob.glob(os.path.join(COMPAT, framework, framework, "**", "*.py"), recursive=True)
        assert files
        unlicensed = [f for f in files if header not in open(f).read()[:1500]]
        assert not unlicensed, unlicensed
    for version in ("verl 0.7.1", "verifiers 0.1.14", "openenv 0.10.0", "Apache-2.0", "MIT", "BSD-3-Clause"):
        assert version in readme
