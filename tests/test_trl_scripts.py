"""A script written for TRL 1.16's GRPOTrainer trains here with only its import line changed (issue 59): a game
script in the shape of TRL's environment_factory examples (tests/trl_scripts/grid_walk.py: a walk of at least 5
moves in `environment_factory`, a `prompt`-only dataset, one `reward_funcs` callable that requires `environments`,
`peft_config`) runs under TRL itself and under this trainer; both allow the same calls and describe the tool
alike; a scripted player's 8 moves all run under both trainers' defaults; no default of the knowledge base reaches
another task; and TRL's reward keywords reach every reward. TRL's own scripts (issue 78: examples/scripts/grpo_agent.py
and grpo_2048.py, the docs' tools, environment, external-dataset and multiple-environment examples, in
tests/trl_scripts/) under TRL's GRPOTrainer and ours with one scripted player: the same calls run, the model sees
byte-identical text at every turn (failed calls included), and TRL's tool, reward and token metrics are equal; the
difference that remains is a strict xfail. Issue 80: TRL's docs' tool that returns an image, on a tiny Qwen2-VL, shows
and forwards the same images under both."""

import importlib.util
import json
import math
import os
import re
import runpy
import subprocess
import sys

import pytest
from helpers import ROOT, make_chat_template_agent

SCRIPT = os.path.join(ROOT, "tests", "trl_scripts", "grid_walk.py")
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
OUR_IMPORT = "from mt_grpo_trainer import MTGRPOConfig as GRPOConfig, MTGRPOEnvTrainer as GRPOTrainer"
MOVES = ["right"] * 4 + ["down"] * 4  # the shortest walk to the treasure


@pytest.fixture(scope="module")
def model_dir(tiny_agent_dir, tmp_path_factory):
    """The tiny agent with Qwen2.5's chat template, which TRL needs to call tools."""
    return make_chat_template_agent(tiny_agent_dir, str(tmp_path_factory.mktemp("tiny-agent-qwen-template")))


@pytest.fixture(scope="module")
def game():
    """The script's module (its game, reward and prompt), imported without running it."""
    spec = importlib.util.spec_from_file_location("grid_walk", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def swapped_script(tmp_path) -> str:
    """The script with its import line, and nothing else, changed to this trainer's."""
    with open(SCRIPT) as f:
        text = f.read()
    assert text.count(TRL_IMPORT) == 1
    path = tmp_path / "grid_walk_mt_grpo.py"
    path.write_text(text.replace(TRL_IMPORT, OUR_IMPORT))
    changed = [(a, b) for a, b in zip(text.splitlines(), path.read_text().splitlines()) if a != b]
    assert changed == [(TRL_IMPORT, OUR_IMPORT)]
    return str(path)


@pytest.mark.parametrize("trainer", ["trl", "mt_grpo"])
def test_a_trl_game_script_trains_under_both_trainers_with_only_its_import_changed(trainer, model_dir, tmp_path):
    script = SCRIPT if trainer == "trl" else swapped_script(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "TRL_SCRIPT_MODEL": model_dir, "TRL_SCRIPT_OUTPUT": str(out), "PYTHONPATH": ROOT,
           "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # from another folder than the repository's, as a user's script runs
    proc = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(out / "log_history.json") as f:
        steps = [h for h in json.load(f) if "loss" in h]
    assert len(steps) == 1 and math.isfinite(steps[0]["loss"]) and math.isfinite(steps[0]["grad_norm"])
    # TRL's metric names in both runs (issue 70: a TRL dashboard reads ours), and ours beside them
    assert TRL_STEP_METRICS <= set(steps[0]), sorted(TRL_STEP_METRICS - set(steps[0]))
    assert trainer == "trl" or "rewards/outcome/reward_walk" in steps[0]


# What TRL 1.16 logs at a step of this script (no KL: beta 0; no vLLM), every name of which a run here logs too
TRL_STEP_METRICS = {"loss", "grad_norm", "learning_rate", "num_tokens", "entropy", "reward", "reward_std",
                    "frac_reward_zero_std", "rewards/reward_walk/mean", "rewards/reward_walk/std",
                    "completions/mean_length", "completions/min_length", "completions/max_length",
                    "completions/clipped_ratio", "completions/mean_terminated_length",
                    "completions/min_terminated_length", "completions/max_terminated_length",
                    "tools/call_frequency", "tools/failure_frequency", "clip_ratio/low_mean", "clip_ratio/low_min",
                    "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "step_time"}


def our_config(tmp_path, **overrides):
    from mt_grpo_trainer import MTGRPOConfig

    kwargs = dict(output_dir=str(tmp_path / "ours"), max_completion_length=2048, per_device_train_batch_size=2,
                  num_generations=2, max_steps=1, bf16=False, report_to="none", logging_steps=1,
                  save_strategy="no", chat_template_kwargs={"enable_thinking": False})
    return MTGRPOConfig(**{**kwargs, **overrides})


def trl_config(tmp_path):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path / "trl"), max_completion_length=2048, per_device_train_batch_size=2,
                      num_generations=2, max_steps=1, bf16=False, report_to="none", logging_steps=1,
                      save_strategy="no", chat_template_kwargs={"enable_thinking": False})


def counting(game):
    """The script's game, counting the moves of its current episode."""

    class Counted(game.GridWalkEnv):
        def reset(self, **kwargs):
            self.moves = 0
            return super().reset(**kwargs)

        def step(self, direction: str) -> str:
            """
            Take one step on the grid.

            Args:
                direction: One of "up", "down", "left", "right".
            """
            self.moves += 1
            return super().step(direction)

    return Counted


def dataset(game, rows: int = 2):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": game.PROMPT}] for _ in range(rows)]})


def test_both_trainers_allow_the_same_calls_and_show_the_tool_the_same_description(game, model_dir, tmp_path):
    """TRL's default allows tool calls until the completion budget; so do ours (no max_env_steps, no per-turn cap,
    no cut of a tool's reply but the budget). The docstring's argument description reaches the model in both. By
    default (`tool_format: auto`) the model's own calls run, as under TRL: Qwen's template writes tools."""
    from transformers.utils import get_json_schema
    from trl import GRPOTrainer

    from mt_grpo_trainer import MTGRPOEnvTrainer

    theirs = GRPOTrainer(model=model_dir, reward_funcs=game.reward_walk, args=trl_config(tmp_path),
                         train_dataset=dataset(game), environment_factory=game.GridWalkEnv)
    ours = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, args=our_config(tmp_path),
                            train_dataset=dataset(game), environment_factory=game.GridWalkEnv)
    assert theirs.max_tool_calling_iterations == sys.maxsize and ours.env.max_env_steps == math.inf
    assert ours.env.max_tokens_per_turn == ours.env.max_tool_response_tokens == 2048
    # by default, the model's own tool calls: the template gets the very schema TRL gives it
    assert ours.args.tool_format == ours.env.protocol.name == "chat_template"
    assert ours.env.environments.template_tools[None] == [get_json_schema(t) for t in theirs.tools]
    schema = get_json_schema(theirs.tools[0])["function"]
    assert schema["parameters"]["properties"]["direction"]["description"] == 'One of "up", "down", "left", "right".'
    xml = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, train_dataset=dataset(game),
                           args=our_config(tmp_path, tool_format="xml"), environment_factory=game.GridWalkEnv)
    system = xml.env.prompt(dataset(game)[0]["prompt"], xml.env.environments.tools())[0]["content"]
    assert f"step(direction: str) -> str: {schema['description']}" in system
    assert f"    direction: {schema['parameters']['properties']['direction']['description']}" in system


def test_a_scripted_player_makes_all_8_moves_under_both_trainers_defaults(game, model_dir, tmp_path):
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from mt_grpo_trainer import MTGRPOEnvTrainer
    from scripted_policy import ScriptedPolicy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hermes = [f'<tool_call>\n{{"name": "step", "arguments": {{"direction": "{d}"}}}}\n</tool_call><|im_end|>'
              for d in MOVES]
    xml = [f'<reasoning>Go {d}.</reasoning><tool>{{"name": "step", "args": {{"direction": "{d}"}}}}</tool>'
           for d in MOVES]
    done = "I have played my moves.<|im_end|>"

    class ScriptedTRL(GRPOTrainer):
        """TRL's own tool loop, with the scripted player in place of model.generate."""

        player = ScriptedPolicy(tokenizer, {game.PROMPT: hermes + [done]})

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            return [tokenizer.encode(self.player.turn_text(ids), add_special_tokens=False) for ids in prompt_ids], None

    Counted = counting(game)
    theirs = ScriptedTRL(model=model_dir, reward_funcs=game.reward_walk, args=trl_config(tmp_path),
                         train_dataset=dataset(game), environment_factory=Counted)
    theirs.train()
    assert [env.moves for env in theirs._environment_pool[None]] == [8, 8]
    trl_step = [h for h in theirs.state.log_history if "loss" in h][0]
    # the same player, the same template calls: ours runs them by default, as TRL does (issue 78, point 1: with the
    # import alone they ran none); the xml protocol where a recipe chooses it
    for tool_format, turns in (("auto", hermes), ("xml", xml)):
        ours = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, train_dataset=dataset(game),
                                args=our_config(tmp_path, tool_format=tool_format), environment_factory=Counted,
                                backend=ScriptedPolicy(tokenizer, {game.PROMPT: turns + [done]}))
        ours.train()
        assert [env.moves for env in ours.env.environments.free[None]] == [8, 8], tool_format
        stops = [h for h in ours.state.log_history if "loss" in h][0]
        assert stops["rollout/tool_calls_per_episode"] == 8 and stops["rollout/stop/no_action"] == 1.0
        assert stops["tools/call_frequency"] == 8.0
        if tool_format == "auto":  # the same text as TRL's: TRL's num_tokens (prompts and sampled tokens) agrees
            assert stops["num_tokens"] == trl_step["num_tokens"] and trl_step["tools/call_frequency"] == 8.0


def test_no_default_of_the_knowledge_base_reaches_another_task(game, model_dir, tmp_path):
    """A `prompt` dataset with a tool, and an environment without a dataset: no search tool, no turn reward that
    reads `answer`, no word of question answering in the prompt; the advantage follows the signals given. The
    environment's run leaves `dataset_name` at its default, as a TRL script does (issue 70: it was refused)."""
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOEnvTrainer
    from mt_grpo.tasks.fictional_kb import SEARCH_TASK_PROMPT

    def multiply(a: float, b: float) -> str:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return f"{a * b:g}"

    def reward(completions, **kwargs):
        return [1.0] * len(completions)

    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Multiply 6 by 7 with the tool."}]] * 2})
    built = [MTGRPOEnvTrainer(model=model_dir, reward_funcs=reward, args=our_config(tmp_path), train_dataset=prompts,
                              tools=[multiply]),
             MTGRPOEnvTrainer(model=model_dir, reward_funcs=reward, environment_factory=game.GridWalkEnv,
                              args=our_config(tmp_path))]  # `dataset_name` at its default: no dataset, as in TRL
    for trainer, tools in zip(built, (["multiply"], ["step"])):
        env = trainer.env
        names = sorted(env.tools) if env.environments is None else [t.__name__ for t in env.environments.tools()]
        assert names == tools
        assert trainer.turn_reward_funcs == [] and trainer.outcome_reward_funcs == [reward]
        assert trainer.advantage_mode == "outcome_only"
        row = trainer.train_dataset[0]
        text = json.dumps(row["prompt"])
        for kb_text in (SEARCH_TASK_PROMPT, "answer questions", "<answer>", "search"):
            assert kb_text not in text, kb_text
    # an environment with step_rewards: per-turn credit, from its own rewards only
    class Scored(game.GridWalkEnv):
        def reset(self, **kwargs):
            self.step_rewards = []
            return super().reset(**kwargs)

        def step(self, direction: str) -> str:
            """
            Take one step on the grid.

            Args:
                direction: One of "up", "down", "left", "right".
            """
            before = self._distance()
            out = super().step(direction)
            self.step_rewards.append(float(before - self._distance()))
            return out

    Scored.step_rewards = []  # the probe instance is never reset: the class says it keeps the list
    stepped = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, environment_factory=Scored,
                               args=our_config(tmp_path, dataset_name=None))
    assert stepped.advantage_mode == "per_turn"
    assert [f.__name__ for f in stepped.turn_reward_funcs] == ["Scored_steps"]
    # the knowledge base keeps its own: the search tool and its rewards
    kb = MTGRPOEnvTrainer(model=model_dir, args=our_config(tmp_path, dataset_name="fictional_kb", max_samples=4))
    assert sorted(kb.env.tools) == ["search"] and kb.advantage_mode == "mt_grpo"
    assert [f.__name__ for f in kb.turn_reward_funcs] == ["tool_execution_reward_func", "answer_in_tool_result"]
    assert SEARCH_TASK_PROMPT.split("\n")[0] in kb.train_dataset[0]["prompt"][0]["content"]


def test_reward_funcs_take_trls_forms_and_every_reward_gets_trls_keywords(model_dir, tmp_path):
    """`reward_funcs` as TRL takes it (one function, a name, a list; `reward_weights`), @per_tool_turn ones as turn
    rewards, and TRL's keywords (completion_ids, trainer_state, log_extra, log_metric) for a reward that requires
    them; what it logs reaches the step's metrics and the completions table."""
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOEnvTrainer
    from mt_grpo.rewards.conversation import per_tool_turn
    from scripted_policy import ScriptedPolicy

    seen = {}

    def keyworded(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(step=trainer_state.global_step, lengths=[len(ids) for ids in completion_ids])
        log_metric("my/length", float(sum(map(len, completion_ids))) / len(completion_ids))
        log_extra("my_column", [str(len(ids)) for ids in completion_ids])
        return [0.5 if "<answer>" in c[-1]["content"] else 0.0 for c in completions]

    @per_tool_turn
    def each_turn(completions, **kwargs):
        return [[1.0] * sum(m["role"] == "assistant" and bool(m.get("tool_calls")) for m in c) for c in completions]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_dict({"question": ["What is 6 times 7?"] * 2, "answer": ["42"] * 2})
    script = {"What is 6 times 7?": [["<answer>42</answer><|im_end|>"], ["I do not know.<|im_end|>"]]}
    trainer = MTGRPOEnvTrainer(model=model_dir, reward_funcs=[keyworded, "exact_match_reward_func", each_turn],
                               args=our_config(tmp_path, reward_weights=[1.0, 2.0, 1.0]), train_dataset=data,
                               backend=ScriptedPolicy(tokenizer, script))
    assert [f.__name__ for f in trainer.outcome_reward_funcs] == ["keyworded", "exact_match_reward_func"]
    assert [f.__name__ for f in trainer.turn_reward_funcs] == ["each_turn"]
    assert trainer.outcome_weights.tolist() == [1.0, 2.0] and trainer.turn_weights.tolist() == [1.0]
    assert trainer.args.reward_weights == [1.0, 2.0, 1.0]  # TRL's field, as the user set it
    trainer.train()
    step = [h for h in trainer.state.log_history if "loss" in h][0]
    assert seen["step"] == 0 and len(seen["lengths"]) == 2 and min(seen["lengths"]) > 0
    assert step["my/length"] == pytest.approx(sum(seen["lengths"]) / 2)
    assert step["rewards/outcome/mean"] == pytest.approx((0.5 + 2.0 + 0.0) / 2)
    assert list(trainer._logs["extra"]["my_column"]) == [str(n) for n in seen["lengths"]]
    # one function alone, as TRL takes it, and a name alone
    for single in (keyworded, "exact_match_reward_func"):
        alone = MTGRPOEnvTrainer(model=model_dir, reward_funcs=single, args=our_config(tmp_path), train_dataset=data,
                                 backend=ScriptedPolicy(tokenizer, script))
        assert len(alone.outcome_reward_funcs) == 1 and alone.turn_reward_funcs == []


def test_reward_weights_in_the_config_weigh_the_functions_given_to_the_trainer(model_dir, tmp_path):
    """`outcome_reward_weights` / `turn_reward_weights` in the config, with the functions given to
    MTGRPOEnvTrainer(...) (issue 70: the config was refused before the trainer existed); weights without functions
    anywhere, or a count that differs, fail at the trainer naming the field."""
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOEnvTrainer
    from mt_grpo.rewards.conversation import per_tool_turn

    def short(completions, **kwargs):
        return [1.0] * len(completions)

    def polite(completions, **kwargs):
        return [0.5] * len(completions)

    @per_tool_turn
    def each_turn(completions, **kwargs):
        return [[] for _ in completions]

    data = Dataset.from_dict({"prompt": ["Say hello."] * 2})
    config = our_config(tmp_path, outcome_reward_weights=[1.0, 2.0], turn_reward_weights=[0.5])  # no functions here
    trainer = MTGRPOEnvTrainer(model=model_dir, args=config, train_dataset=data, outcome_reward_funcs=[short, polite],
                               turn_reward_funcs=[each_turn])
    assert trainer.outcome_weights.tolist() == [1.0, 2.0] and trainer.turn_weights.tolist() == [0.5]
    with pytest.raises(ValueError, match=r"`outcome_reward_weights` has 2 values but `outcome_reward_funcs` has 1 "):
        MTGRPOEnvTrainer(model=model_dir, args=config, train_dataset=data, outcome_reward_funcs=[short],
                         turn_reward_funcs=[each_turn])
    with pytest.raises(ValueError, match=r"`outcome_reward_weights` is set but `outcome_reward_funcs` is not, in the "
                                         r"config or to MTGRPOEnvTrainer"):
        MTGRPOEnvTrainer(model=model_dir, args=our_config(tmp_path, outcome_reward_weights=[1.0]), train_dataset=data,
                         reward_funcs=short)


def test_trls_multi_environment_dataset_trains_and_logs_trls_metric_names(model_dir, tmp_path):
    """TRL's multi-environment example (issue 70): a dict of factories and a dataset of only an `environment` column,
    with `dataset_name` left at its default; each row's reset gives its prompt and its class's tools. One step logs
    TRL's metric names beside ours, with TRL's definitions, by hand; a row with an empty prompt is not malformed."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from env_examples import Counter, Lock, counter_value
    from helpers import rollout_records
    from mt_grpo_trainer import MTGRPOEnvTrainer
    from scripted_policy import ScriptedPolicy

    class Counting(Counter):
        def reset(self, **kwargs):
            super().reset(**kwargs)
            return "Count to 4."

    call = '<reasoning>Go.</reasoning>\n<tool>{{"name": "{}", "args": {}}}</tool>'
    done = "<reasoning>So.</reasoning>\n<answer>done</answer>"
    # the lock (code "12", Lock's default): one wrong press, then both right; the counter: one add
    script = {"The lock has 2 digits.": [call.format("press", '{"digit": 2}'), call.format("press", '{"digit": 1}'),
                                         call.format("press", '{"digit": 2}'), done],
              "Count to 4.": [call.format("add", '{"amount": 4}'), done]}
    factories = {"lock": Lock, "counter": Counting}
    config = our_config(tmp_path, per_device_train_batch_size=4, save_rollouts_steps=1, max_completion_length=512,
                        tool_format="xml")  # the player writes xml calls (the default, auto, would take Qwen's own)
    trainer = MTGRPOEnvTrainer(model=model_dir, reward_funcs=counter_value, args=config, environment_factory=factories,
                               train_dataset=Dataset.from_dict({"environment": ["lock", "counter"]}),
                               backend=ScriptedPolicy(AutoTokenizer.from_pretrained(model_dir), script))
    assert trainer.advantage_mode == "per_turn"  # Lock's step rewards
    assert [f.__name__ for f in trainer.turn_reward_funcs + trainer.outcome_reward_funcs] == \
        ["Lock_steps", "counter_value", "Lock"]
    trainer.train()
    step = [h for h in trainer.state.log_history if "loss" in h][0]
    records = rollout_records(config.output_dir)
    lock, counter = (next(r for r in records if r["environment"] == name) for name in ("Lock", "Counting"))
    assert "press(" in lock["prompt_text"] and "add(" not in lock["prompt_text"] and "add(" in counter["prompt_text"]
    # each function's per-sample value (a per-turn one: the mean of its turns): Lock_steps (-0.5 + 1 + 1) / 3 on the
    # locks, None on the counters; counter_value 4 on the counters; Lock 1 on the locks
    steps = 1.5 / 3
    assert step["rewards/Lock_steps/mean"] == pytest.approx(steps) and step["rewards/Lock_steps/std"] == 0.0
    assert step["rewards/counter_value/mean"] == 4.0 and step["rewards/Lock/mean"] == 1.0
    assert step["rewards/outcome/Lock"] == 1.0  # ours beside
    # `reward`: each sample's weighted sum, 1.5 on the locks and 4 on the counters; every group alike within
    assert step["reward"] == pytest.approx((2 * (steps + 1) + 2 * 4) / 4)
    assert step["reward_std"] == pytest.approx(torch_std([steps + 1] * 2 + [4.0] * 2))
    assert step["frac_reward_zero_std"] == 1.0
    # tools: 3 calls per lock and 1 per counter, over 4 episodes; one wrong press is no failure (it returned)
    assert step["tools/call_frequency"] == 2.0 and step["tools/failure_frequency"] == 0.0
    lengths = [sum(r["tokens"]["model_mask"]) for r in records]
    assert step["completions/mean_length"] == pytest.approx(sum(lengths) / 4)
    assert (step["completions/min_length"], step["completions/max_length"]) == (min(lengths), max(lengths))
    assert step["completions/clipped_ratio"] == 0.0 and step["completions/mean_terminated_length"] == \
        pytest.approx(sum(lengths) / 4)
    # an empty prompt, TRL's placeholder, is a prompt the environment fills, not a malformed row
    empty = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * 2, "environment": ["lock", "counter"]})
    again = MTGRPOEnvTrainer(model=model_dir, reward_funcs=counter_value, args=config, environment_factory=factories,
                             train_dataset=empty)
    assert [row["environment"] for row in again.train_dataset] == ["lock", "counter"]


def torch_std(values: list[float]) -> float:
    """The sample standard deviation (Bessel's correction), as TRL's nanstd."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def test_the_sampler_gap_is_logged_under_trls_names_too():
    """`sampling/sampling_logp_difference/...` and `sampling/importance_sampling_ratio/...` (TRL's names) over the
    model tokens, beside ours, by hand on one process; a token off the mask counts for none."""
    from collections import defaultdict

    import torch
    from accelerate import Accelerator

    from mt_grpo.run.reporting import TrainerReports

    reports = TrainerReports()
    reports.accelerator, reports._metrics = Accelerator(cpu=True), {"train": defaultdict(list)}
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    weights = torch.tensor([[0.5, 2.0, 1.0], [1.5, 1.0, 1.0]])
    trainer = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    reports._log_sampler_gap("train", weights, mask, trainer, sampler, None, torch.tensor([[0, 1, -1], [0, -1, -1]]))
    m = {k: v[-1] for k, v in reports._metrics["train"].items()}
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert m["sampling/sampling_logp_difference/max"] == 1.0  # not the 9 of the token off the mask
    assert (m["sampling/importance_sampling_ratio/min"], m["sampling/importance_sampling_ratio/max"]) == (0.5, 2.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(4.0 / 3) == m["sampling/importance_weight_mean"]


# ------------------------------------------------------------------------------------------------
# TRL's example-script shape: TrlParser((ScriptArguments, GRPOConfig, ModelConfig)), load_dataset, `answer`
# ------------------------------------------------------------------------------------------------
QA_SCRIPT = os.path.join(ROOT, "tests", "trl_scripts", "grpo_qa.py")
QA_TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config"
QA_OUR_IMPORT = ("from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config\n"
                 "from mt_grpo_trainer import MTGRPOConfig as GRPOConfig, MTGRPOEnvTrainer as GRPOTrainer")


def test_a_trl_script_with_the_three_class_parser_trains_here_on_string_answers(model_dir, tmp_path,
                                                                                 monkeypatch):
    """TRL's ScriptArguments and our config both know `dataset_name` and `dataset_config`; TRL's own TrlParser
    takes both classes (ours takes the two as constructor keywords), the recipe's dataset_name reaches
    ScriptArguments, and the script's reward reads `answer` as the string the file holds, while the rollout
    records keep its aliases."""
    import yaml

    with open(QA_SCRIPT) as f:
        text = f.read()
    assert text.count(QA_TRL_IMPORT) == 1
    script = tmp_path / "grpo_qa_mt_grpo.py"
    script.write_text(text.replace(QA_TRL_IMPORT, QA_OUR_IMPORT))
    data = tmp_path / "qa"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": "What is the capital of Veltria?"}], "answer": "Morvane"},
            {"prompt": [{"role": "user", "content": "Who built the sky loom?"}], "answer": "Pella Rusk"}]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    recipe = {"model_name_or_path": model_dir, "dataset_name": str(data), "output_dir": str(out), "max_steps": 1,
              "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 48, "bf16": False,
              "use_cpu": True, "report_to": "none", "logging_steps": 1, "save_strategy": "no",
              "save_rollouts_steps": 1}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    # run as `python grpo_qa_mt_grpo.py --config recipe.yaml` from its folder, in this process (no second start-up)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "--config", "recipe.yaml"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runpy.run_path(str(script), run_name="__main__")
    from helpers import rollout_records

    assert (out / "model.safetensors").is_file()  # the script's save_model, after its one step
    records = rollout_records(str(out))  # one question, two episodes: the step's group
    assert len(records) == 2 and {r["step"] for r in records} == {1}
    # `answer` as the file holds it (the reward's `.lower()` ran on it), the aliases beside it
    assert {(r["question"], r["answer"], tuple(r["answer_aliases"])) for r in records} in (
        {("What is the capital of Veltria?", "Morvane", ("Morvane",))},
        {("Who built the sky loom?", "Pella Rusk", ("Pella Rusk",))})
    assert all(r["rewards"]["outcome"]["accuracy_reward"] in (0.0, 1.0) for r in records)


# ------------------------------------------------------------------------------------------------
# TRL's own scripts (issue 78's "done when"): the same scripted player under TRL's GRPOTrainer and ours runs the same
# calls, the model sees byte-identical text at every turn, and TRL's metrics agree
# ------------------------------------------------------------------------------------------------
def load_script(name: str):
    """A script of tests/trl_scripts, imported without running its main block."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tests", "trl_scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hermes(*calls) -> str:
    """A model turn of Qwen's template with these (name, arguments) calls."""
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls) + \
        "<|im_end|>"


def side_by_side(model_dir, tmp_path, script: dict, config: dict, ours_only: dict | None = None, built=None,
                 **trainer_kwargs):
    """One step of TRL's GRPOTrainer and of ours, built with the same keywords and the same config values, with the
    same scripted player writing `script`'s turns. Returns, for each trainer, what the model saw and wrote at each
    turn (decoded, sorted), each sample's (prompt, completion, sampled-token count, completion-token count) as the
    trainer holds them, and the step's log row. `built(name, trainer)` sees each trainer before it trains."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
    from scripted_policy import ScriptedPolicy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = dict(max_completion_length=512, per_device_train_batch_size=4, num_generations=2, max_steps=1, bf16=False,
                report_to="none", logging_steps=1, save_strategy="no", chat_template_kwargs={"enable_thinking": False})
    seen = {"trl": [], "mt_grpo": []}
    finals = {"trl": [], "mt_grpo": []}

    class Player(ScriptedPolicy):
        """The scripted player, noting what the model sees and writes at each turn."""

        def __init__(self, name):
            super().__init__(tokenizer, script)
            self.name = name

        def turn_text(self, ids, sample=0):
            text = super().turn_text(ids, sample)
            seen[self.name].append(tokenizer.decode(ids) + text)
            return text

    class ScriptedTRL(GRPOTrainer):
        """TRL's own tool loop, with the scripted player in place of model.generate."""

        player = Player("trl")

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            return [tokenizer.encode(self.player.turn_text(ids), add_special_tokens=False) for ids in prompt_ids], None

        def _generate(self, prompts):
            out = super()._generate(prompts)
            finals["trl"] += [(tokenizer.decode(p), tokenizer.decode(c), sum(m), len(c)) for p, c, m in zip(*out[:3])]
            return out

    theirs = ScriptedTRL(args=GRPOConfig(output_dir=str(tmp_path / "trl"), **{**base, **config}), **trainer_kwargs)
    if built is not None:
        built("trl", theirs)
    theirs.train()
    ours_config = {**base, **config, **(ours_only or {})}
    ours = MTGRPOEnvTrainer(args=MTGRPOConfig(output_dir=str(tmp_path / "ours"), **ours_config),
                            backend=Player("mt_grpo"), **trainer_kwargs)
    rollout = ours.env.rollout

    def recorded(*args, **kwargs):
        episodes = rollout(*args, **kwargs)
        finals["mt_grpo"] += [(tokenizer.decode(ep.prompt_ids), tokenizer.decode(ep.completion_ids), sum(ep.model_mask),
                               len(ep.completion_ids)) for ep in episodes]
        return episodes

    ours.env.rollout = recorded
    if built is not None:
        built("mt_grpo", ours)
    ours.train()
    steps = {name: [h for h in t.state.log_history if "loss" in h][0]
             for name, t in (("trl", theirs), ("mt_grpo", ours))}
    return ({k: sorted(v) for k, v in seen.items()}, {k: sorted(v) for k, v in finals.items()}, steps)


def first_difference(ours: list, theirs: list) -> str:
    """Where two lists of texts first differ, with a little context, for the assertion's message."""
    if len(ours) != len(theirs):
        return f"{len(ours)} texts here against {len(theirs)} under TRL"
    a, b = next((str(x), str(y)) for x, y in zip(ours, theirs) if x != y)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {at}: here {a[max(0, at - 120):at + 160]!r}\nunder TRL {b[max(0, at - 120):at + 160]!r}"


def assert_as_under_trl(seen, finals, steps, calls_per_episode: float):
    # byte-identical text at every turn; each sample's prompt, completion (tool results in it) and sampled tokens
    assert seen["mt_grpo"] == seen["trl"], first_difference(seen["mt_grpo"], seen["trl"])
    assert finals["mt_grpo"] == finals["trl"], first_difference(finals["mt_grpo"], finals["trl"])
    trl, ours = steps["trl"], steps["mt_grpo"]
    assert trl["tools/call_frequency"] == calls_per_episode
    names = ["tools/call_frequency", "tools/failure_frequency", "reward", "reward_std", "num_tokens",
             "completions/mean_length", "completions/max_length"] + [k for k in trl if k.startswith("rewards/")]
    assert {k: ours.get(k) for k in names} == pytest.approx({k: trl[k] for k in names})
    # issue 78, point 3: TRL's num_tokens counts prompts and sampled tokens; ours, every completion token (tool
    # replies included), is rollout/completion_tokens_seen
    assert ours["rollout/completion_tokens_seen"] == sum(n for *_, n in finals["trl"])


# A second call of the TP53 turn: one that runs, or one of the three failures TRL's tool loop answers with
# `str({"error": message})` (a tool that raised, a name no tool has, arguments that do not fit), shown as TRL shows it
SECOND_CALLS = {
    "runs": ("query_biogrid", {"sql_command": "SELECT Taxid_Interactor_A FROM interactions WHERE "
                                              "Aliases_Interactor_B = 'HDM2'"}),
    "raises": ("query_biogrid", {"sql_command": "SELECT * FROM nope"}),  # {'error': 'no such table: nope'}
    "unknown_tool": ("query_biogrd", {"sql_command": "SELECT 1"}),  # {'error': 'Tool query_biogrd not found.'}
    "bad_arguments": ("query_biogrid", {"sql": "SELECT 1"}),  # Python's TypeError, before the tool's first line
}
TRL_ERRORS = {"raises": "{'error': 'no such table: nope'}",
              "unknown_tool": "{'error': 'Tool query_biogrd not found.'}",
              "bad_arguments": "{'error': \"query_biogrid() got an unexpected keyword argument 'sql'\"}"}


@pytest.mark.parametrize("second", list(SECOND_CALLS))
def test_trls_grpo_agent_script_runs_the_same_sql_and_shows_the_same_text(second, model_dir, tmp_path, monkeypatch):
    """examples/scripts/grpo_agent.py: `tools=[query_biogrid]` (list[tuple] returns, a `signal` timeout), three
    rewards reading tool_calls and tool messages, an `answer` column; a turn with two calls, the first of which
    runs or fails as SECOND_CALLS says: the failure reads as under TRL, byte for byte, and counts as failed in
    `tools/failure_frequency`, the records and the rewards that read failures."""
    import functools

    from mt_grpo.rewards.conversation import failed

    agent = load_script("grpo_agent")
    monkeypatch.chdir(tmp_path)  # the tool opens biogrid.db in the folder it runs in
    agent.create_db()
    sql = []

    @functools.wraps(agent.query_biogrid)
    def query_biogrid(sql_command: str) -> list[tuple]:
        sql.append(sql_command)
        return agent.query_biogrid(sql_command)

    yes = "SELECT Aliases_Interactor_B FROM interactions WHERE Aliases_Interactor_A LIKE '%JNKK%'"
    no = "SELECT * FROM interactions WHERE Aliases_Interactor_A LIKE '%TP53%' AND Alt_IDs_Interactor_B LIKE '%BARD1%'"
    other = SECOND_CALLS[second]
    script = {"Does the gene JNKK": [hermes(("query_biogrid", {"sql_command": yes})), "It does: *Yes*<|im_end|>"],
              "Does the gene TP53": [hermes(other, ("query_biogrid", {"sql_command": no})), "*No*<|im_end|>"]}
    # the prompt (the preamble and the tool's schema) is over 1,024 tokens: no cap by default, as TRL 1.16 has none
    seen, finals, steps = side_by_side(
        model_dir, tmp_path, script, {"max_completion_length": 1024},
        model=model_dir, train_dataset=agent.train_dataset(), tools=[query_biogrid],
        reward_funcs=[agent.correctness_reward, agent.structure_reward, agent.query_reward])
    ran = [other[1]["sql_command"]] if second in ("runs", "raises") else []  # the calls that reached the tool
    half = len(sql) // 2
    assert sorted(sql[:half]) == sorted(sql[half:]) == sorted([yes] * 2 + (ran + [no]) * 2)
    assert_as_under_trl(seen, finals, steps, calls_per_episode=1.5)
    assert steps["trl"]["tools/failure_frequency"] == pytest.approx(0.0 if second == "runs" else 2 / 6)
    if second != "runs":  # TRL's text in what the model saw, read as a failure by our rewards
        assert sum(TRL_ERRORS[second] in text for text in seen["trl"]) == 2  # each TP53 episode's second turn
        assert failed({"role": "tool", "content": TRL_ERRORS[second]})


def test_a_trl_script_with_a_long_prompt_builds_with_only_its_import_changed(model_dir, tmp_path, monkeypatch):
    """TRL 1.16 has no max_prompt_length, and neither has ours by default: a prompt of 1,134 tokens is kept (with the
    old default of 1,024 every row was dropped and the build refused)."""
    from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

    agent = load_script("grpo_agent")
    monkeypatch.chdir(tmp_path)
    agent.create_db()
    rows = agent.train_dataset()
    trainer = MTGRPOEnvTrainer(model=model_dir, train_dataset=rows, tools=[agent.query_biogrid],
                               reward_funcs=[agent.correctness_reward, agent.structure_reward, agent.query_reward],
                               args=MTGRPOConfig(output_dir=str(tmp_path / "ours"), max_completion_length=1024,
                                                 per_device_train_batch_size=4, num_generations=2, bf16=False,
                                                 report_to="none", chat_template_kwargs={"enable_thinking": False}))
    assert trainer.args.max_prompt_length is None and len(trainer.train_dataset) == len(rows)


@pytest.mark.parametrize("budget", [2048, 512])  # 512: the fourth move's board passes the completion budget
def test_trls_grpo_2048_script_plays_the_same_moves_on_the_same_boards(budget, model_dir, tmp_path):
    """examples/scripts/grpo_2048.py: `environment_factory=Game2048Env`, a reward over `environments`, LoRA. The
    game spawns tiles from the module's `random`; each episode here draws from its own generator (seeded alike), so
    that the order in which the trainers reset and step their instances does not change the boards."""
    import random

    from peft import LoraConfig

    game = load_script("grpo_2048")
    played = []

    class Seeded(game.Game2048Env):
        def reset(self, **kwargs):
            self.rng = random.Random(0)
            return super().reset(**kwargs)

        def move(self, direction: str) -> str:
            """
            Play one move in 2048.

            Args:
                direction: One of "up", "down", "left", "right".

            Returns:
                Environment feedback after the move.
            """
            played.append(direction)
            return super().move(direction)

        def _spawn(self) -> None:  # the script's, drawing from the episode's generator
            empty = [(r, c) for r in range(4) for c in range(4) if self.board[r][c] == 0]
            if not empty:
                return
            r, c = self.rng.choice(empty)
            self.board[r][c] = 4 if self.rng.random() < 0.1 else 2

    moves = ["left", "up", "right", "down"]
    script = {game.PROMPT: [hermes(("move", {"direction": d})) for d in moves] + ["I am done.<|im_end|>"]}
    seen, finals, steps = side_by_side(model_dir, tmp_path, script, {"max_completion_length": budget}, model=model_dir,
                                       reward_funcs=game.reward_score,
                                       train_dataset=dataset(game, 4), environment_factory=Seeded,
                                       peft_config=LoraConfig())
    calls = 4 if budget == 2048 else 3  # TRL runs the call whose result passes the budget, and drops the result
    assert len(played) == 2 * 4 * calls and sorted(played[:4 * calls]) == sorted(played[4 * calls:])
    assert_as_under_trl(seen, finals, steps, calls_per_episode=float(calls))


def test_trls_docs_environment_with_a_dataset_and_tools_beside_it(model_dir, tmp_path):
    """The docs' "Providing an external dataset" IncrementEnv (reset(target, **kwargs) -> None, get_reward, no
    reward_funcs) with the "Tools" example's multiply and async async_add beside it: int returns shown as str()."""
    docs = load_script("docs_increment")
    counted = []

    class Counted(docs.IncrementEnv):
        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            counted.append(step)
            return super().increment(step)

    script = {f"Increment the counter to {i}.": [
        hermes(("increment", {"step": min(i, 3)}), ("multiply", {"a": i, "b": 2})),  # targets over 3 are missed
        hermes(("async_add", {"a": i, "b": 1})), "Done.<|im_end|>"] for i in range(1, 7)}
    # the tiny tokenizer (406 tokens, about a character each) makes the three tools' schemas 1,134 tokens long: no cap
    # by default, as TRL has none (test above)
    seen, finals, steps = side_by_side(model_dir, tmp_path, script, {},
                                       model=model_dir, train_dataset=docs.dataset,
                                       environment_factory=Counted, tools=[docs.multiply, docs.async_add])
    assert len(counted) == 8 and sorted(counted[:4]) == sorted(counted[4:])
    assert_as_under_trl(seen, finals, steps, calls_per_episode=3.0)


def seeded(cls):
    """`cls` whose `reset` draws from `random` seeded alike at every reset (the docs' note: "have reset() derive the
    state deterministically from a shared key"), so that the order in which the trainers reset their instances does
    not change the prompts; the module's random state is left as it was."""
    import random

    class Seeded(cls):
        def reset(self, **kwargs):
            state = random.getstate()
            random.seed(0)
            try:
                return super().reset(**kwargs)
            finally:
                random.setstate(state)

    return Seeded


def test_trls_docs_tools_example_runs_sync_and_async_tools_and_their_failures_as_trl(model_dir, tmp_path):
    """The docs' "Tools" example: `tools=[multiply, async_add]` (sync and async, stateless, run concurrently here);
    its dataset and reward are left out of the docs (`...`): a prompt column and a reward reading the tool messages.
    Beside the calls that run: an async tool that raises, and arguments that do not fit an async tool and a sync
    one, each shown as TRL shows it. (TRL's parser casts arguments to the schema's types: {"b": "2"} arrives as 2,
    here too.)"""
    from datasets import Dataset

    docs = load_script("docs_increment")  # its multiply and async_add are the "Tools" example's, verbatim

    def results_reward(completions, **kwargs):
        return [float(sum(m["role"] == "tool" and m["content"] == "42" for m in c)) for c in completions]

    prompts = ["Multiply 6 by 7.", "Add 40 and 2."]
    script = {prompts[0]: [hermes(("multiply", {"a": 6, "b": 7}), ("multiply", {"x": 6})), "42<|im_end|>"],
              # the call that fails before its coroutine exists first: TRL answers it at once, and the awaited
              # calls after (test below)
              prompts[1]: [hermes(("async_add", {"a": 40}), ("async_add", {"a": 40, "b": 2}),
                                  ("async_add", {"a": None, "b": 2})), "42<|im_end|>"]}
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    seen, finals, steps = side_by_side(model_dir, tmp_path, script, {}, model=model_dir, train_dataset=dataset,
                                       tools=[docs.multiply, docs.async_add], reward_funcs=results_reward)
    assert_as_under_trl(seen, finals, steps, calls_per_episode=2.5)
    assert steps["trl"]["tools/failure_frequency"] == pytest.approx(6 / 10) and steps["trl"]["reward"] == 1.0
    for error in ("{'error': \"multiply() got an unexpected keyword argument 'x'\"}",
                  "{'error': \"unsupported operand type(s) for +: 'NoneType' and 'int'\"}",
                  "{'error': \"async_add() missing 1 required positional argument: 'b'\"}"):
        assert sum(error in text for text in seen["mt_grpo"]) == 2, error


def test_trls_docs_environment_example_self_samples_its_prompt_as_under_trl(model_dir, tmp_path):
    """The docs' "Environments" example: no train_dataset (max_steps sets the length), reset() self-samples the target
    and returns the prompt, get_reward scores the episode, no reward_funcs. Beside the right call, one to a name no
    method has and one with an argument the method does not take: TRL's text, from bound methods."""
    docs = load_script("docs_environment")
    prompt = "Increment the counter by 4."  # random.seed(0), then randint(1, 6): 4
    script = {prompt: [hermes(("increment", {"step": 4}), ("incremnt", {"step": 1}), ("increment", {"by": 1})),
                       "Done.<|im_end|>"]}
    seen, finals, steps = side_by_side(model_dir, tmp_path, script, {}, model=model_dir,
                                       environment_factory=seeded(docs.IncrementEnv))
    assert_as_under_trl(seen, finals, steps, calls_per_episode=3.0)
    assert steps["trl"]["reward"] == 1.0 and steps["trl"]["tools/failure_frequency"] == pytest.approx(2 / 3)
    for error in ("{'error': 'Tool incremnt not found.'}",
                  "{'error': \"IncrementEnv.increment() got an unexpected keyword argument 'by'\"}"):
        assert sum(error in text for text in seen["mt_grpo"]) == 4, error  # TRL's 2 placeholder rows, 2 rollouts each


def test_trls_docs_multiple_environments_route_rows_and_show_each_its_own_tools(model_dir, tmp_path):
    """The docs' "Multiple environments" example: a dict environment_factory, a dataset with only an `environment`
    column, each reset returning the prompt, tools whose `...` bodies return None (shown as `None`), a reward that
    branches on the environment type. Each row's rollouts see only their environment's tool."""
    docs = load_script("docs_multi_env")
    coding, game = "Compute the 13th Fibonacci number.", "Reach the goal tile."  # seed 0: randint(1, 20) is 13
    script = {coding: [hermes(("run_code", {"code": "print(233)"})), "233<|im_end|>"],
              game: [hermes(("move", {"action": "up"})), "I moved.<|im_end|>"]}
    seen, finals, steps = side_by_side(
        model_dir, tmp_path, script, {}, model=model_dir, train_dataset=docs.dataset.select(range(2)),
        reward_funcs=docs.reward_func, environment_factory={"coding": seeded(docs.CodingEnv), "game": docs.GameEnv})
    assert_as_under_trl(seen, finals, steps, calls_per_episode=1.0)
    assert steps["trl"]["reward"] == pytest.approx(0.75)  # two coding rollouts at 1.0, two game ones at 0.5
    for prompt, own, other in ((coding, '"run_code"', '"move"'), (game, '"move"', '"run_code"')):
        texts = [t for t in seen["mt_grpo"] if prompt in t]
        assert len(texts) == 4 and all(own in t and other not in t for t in texts)
    assert all("<tool_response>\nNone\n</tool_response>" in t for t in seen["mt_grpo"] if "I moved." in t)


# ------------------------------------------------------------------------------------------------
# TRL's docs' "Multimodal Tool Responses" (issue 80): a tool returning an image and a text block, a dataset whose prompt
# holds {"type": "image"} and whose `images` column fills it
# ------------------------------------------------------------------------------------------------
def watch_forward(model, into: list):
    """Record each row `model.forward` is given into `into`: (its ids without padding, a digest of each of its
    images' patches, in order: a row holds as many images as <|vision_start|> tokens)."""
    import hashlib

    start, forward = model.config.vision_start_token_id, model.forward

    def recording(*args, **kwargs):
        ids, mask, grids = kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("image_grid_thw")
        images = [] if grids is None else list(kwargs["pixel_values"].split([int(g.prod()) for g in grids]))
        for r, row in enumerate(ids):
            row = row if mask is None else row[mask[r].bool()]
            k = int((row == start).sum())
            into.append((tuple(row.tolist()), tuple(hashlib.sha1(p.detach().float().numpy().tobytes()).hexdigest()
                                                    for p in images[:k])))
            images = images[k:]
        return forward(*args, **kwargs)

    model.forward = recording


def test_trls_docs_vlm_tool_script_shows_and_forwards_the_tools_image_as_under_trl(tmp_path):
    """tests/trl_scripts/docs_vlm_tool.py under TRL's GRPOTrainer and ours, with one scripted player. TRL 1.16 parses
    tool calls only with a chat template that renders them, and Qwen2-VL's and Qwen2.5-VL's own (chat_template.json)
    write no tools: it refuses the script at init ("The provided chat template does not support tool calling"), where
    ours trains it with the xml format (tests/test_vision.py). So the side by side runs the tiny Qwen2-VL with
    Qwen3-VL's template (TRL's trl/chat_templates/qwen3_vl.jinja, which writes tools and renders a tool message's
    images), and both trainers get TRL's form of `processing_class`, the model's processor (without its video
    processor: torchvision is not installed, helpers.vl_processor). The same calls run, the model sees the same text
    at every turn (each image's placeholders widened alike), tools/call_frequency and num_tokens agree, and the
    forwards see the same sequences, each with its prompt's image and then the tool's, patch for patch."""
    import hashlib

    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_vl_chat_template

    from helpers import chat_template, vl_processor, with_template
    from prepare_models import make_tiny_vlm

    docs = load_script("docs_vlm_tool")
    tiny = make_tiny_vlm(str(tmp_path / "tiny-vl"), "qwen2_vl")
    own = with_template(tiny, str(tmp_path / "own"), chat_template("qwen2-vl"))
    with pytest.raises(ValueError, match="The provided chat template does not support tool calling"):
        GRPOTrainer(model=own, processing_class=vl_processor(own), reward_funcs=docs.correct, tools=[docs.zoom],
                    train_dataset=docs.dataset, args=GRPOConfig(output_dir=str(tmp_path / "refused"), bf16=False,
                                                                report_to="none", per_device_train_batch_size=2,
                                                                num_generations=2))
    model = with_template(tiny, str(tmp_path / "qwen3-vl"), qwen3_vl_chat_template)
    processor = vl_processor(model)
    trainers, forwards = {}, {"trl": [], "mt_grpo": []}

    def built(name, trainer):
        trainers[name] = trainer
        watch_forward(trainer.model, forwards[name])

    script = {"Which number is drawn?": [hermes(("zoom", {"x": 3})), "It is 3.<|im_end|>"]}
    seen, finals, steps = side_by_side(model, tmp_path, script, {"max_completion_length": 160}, built=built,
                                       model=model, processing_class=processor, train_dataset=docs.dataset,
                                       reward_funcs=docs.correct, tools=[docs.zoom])
    assert_as_under_trl(seen, finals, steps, calls_per_episode=1.0)
    assert trainers["mt_grpo"].env.protocol.name == "chat_template"  # the template writes tools: the model's own calls
    assert trainers["mt_grpo"].env.vision.image_processor is processor.image_processor  # the given processor's
    after_the_tool = [text for text in seen["trl"] if "It is 3." in text]  # the second turn of each of 4 episodes
    assert len(after_the_tool) == 4 and all(text.count("<|vision_start|>") == 2 for text in after_the_tool)
    assert set(forwards["mt_grpo"]) == set(forwards["trl"])  # the same sequences with the same images, in order
    zoomed = processor.image_processor(images=[docs.zoom(3)[0]["image"]], return_tensors="pt")["pixel_values"]
    digest = hashlib.sha1(zoomed.float().numpy().tobytes()).hexdigest()
    rows = set(forwards["trl"])
    assert len(rows) == 2 and all(len(images) == 2 and images[1] == digest for _, images in rows), rows


@pytest.mark.xfail(strict=True, reason=(
    "TRL's tool loop answers a turn's sync calls (and the calls that fail before a coroutine exists) first and its "
    "awaited async calls after them, whatever the model's order; here every turn's results keep the model's order "
    "(and an environment's calls run in it), as the template's unnumbered tool responses need (docs/guide.md, "
    "'From a TRL script')"))
def test_a_turn_that_calls_an_async_tool_before_a_sync_one_reads_as_under_trl(model_dir, tmp_path):
    from datasets import Dataset

    docs = load_script("docs_increment")
    prompt = "Add 40 and 1, then multiply 6 by 7."  # 41, then 42 here; 42, then 41 under TRL
    script = {prompt: [hermes(("async_add", {"a": 40, "b": 1}), ("multiply", {"a": 6, "b": 7})), "42<|im_end|>"]}
    seen, finals, steps = side_by_side(
        model_dir, tmp_path, script, {"per_device_train_batch_size": 2}, model=model_dir,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}]]}),
        tools=[docs.multiply, docs.async_add], reward_funcs=lambda completions, **kw: [1.0] * len(completions))
    assert_as_under_trl(seen, finals, steps, calls_per_episode=2.0)


@pytest.mark.parametrize("name", ["docs_environment", "docs_increment", "docs_multi_env"])
def test_trls_docs_scripts_train_a_step_here_with_only_their_import_changed(name, model_dir, tmp_path, monkeypatch):
    """Each docs script's own main block, its import line swapped and nothing else, run as `python script.py` runs it
    (in this process: no second start-up): its one step trains to a finite loss (the scripts keep TRL's
    logging_steps, 10: the step's metrics are the side-by-side tests')."""
    with open(os.path.join(ROOT, "tests", "trl_scripts", f"{name}.py")) as f:
        text = f.read()
    assert text.count(TRL_IMPORT) == 1
    script = tmp_path / f"{name}_mt_grpo.py"
    script.write_text(text.replace(TRL_IMPORT, OUR_IMPORT))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_SCRIPT_MODEL", model_dir)
    monkeypatch.setenv("TRL_SCRIPT_OUTPUT", str(tmp_path / "out"))
    trainer = runpy.run_path(str(script), run_name="__main__")["trainer"]
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[-1]["train_loss"])


@pytest.mark.parametrize("argument, fix", [
    ("rollout_func", "run that code as an agent (`agent=`, the OpenAI-compatible endpoint"),
    ("reward_processing_classes", "score with a reward function"),
])
def test_trls_arguments_that_mean_nothing_here_are_refused_with_the_fix(argument, fix, model_dir, tmp_path):
    """Issue 78, point 8: TRL's `rollout_func` would replace the multi-turn rollout (refused naming the agent endpoint,
    issue 79), and `reward_processing_classes` tokenize for reward models, which are not loaded: each is refused before
    the model loads, naming what to do."""
    from mt_grpo_trainer import MTGRPOEnvTrainer

    with pytest.raises(ValueError, match=re.escape(fix)):
        MTGRPOEnvTrainer(model=model_dir, args=our_config(tmp_path), reward_funcs=lambda completions, **kw: [0.0],
                         **{argument: object()})
