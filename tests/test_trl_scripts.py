"""A script written for TRL 1.16's GRPOTrainer trains here with only its import line changed (issue 59): a game
script in the shape of TRL's environment_factory examples (tests/trl_scripts/grid_walk.py: a walk of at least 5
moves in `environment_factory`, a `prompt`-only dataset, one `reward_funcs` callable that requires `environments`,
`peft_config`) runs under TRL itself and under this trainer; both allow the same calls and describe the tool
alike; a scripted player's 8 moves all run under both trainers' defaults; no default of the knowledge base reaches
another task; and TRL's reward keywords reach every reward."""

import importlib.util
import json
import math
import os
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
    # the game's reward, under its function's name in TRL's key and in ours
    key = "rewards/reward_walk/mean" if trainer == "trl" else "rewards/outcome/reward_walk"
    assert key in steps[0]


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
    no cut of a tool's reply but the budget). The docstring's argument description reaches the model in both."""
    from transformers.utils import get_json_schema
    from trl import GRPOTrainer

    from mt_grpo_trainer import MTGRPOEnvTrainer

    theirs = GRPOTrainer(model=model_dir, reward_funcs=game.reward_walk, args=trl_config(tmp_path),
                         train_dataset=dataset(game), environment_factory=game.GridWalkEnv)
    ours = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, args=our_config(tmp_path),
                            train_dataset=dataset(game), environment_factory=game.GridWalkEnv)
    assert theirs.max_tool_calling_iterations == sys.maxsize and ours.env.max_env_steps == math.inf
    assert ours.env.max_tokens_per_turn == ours.env.max_tool_response_tokens == 2048
    schema = get_json_schema(theirs.tools[0])["function"]
    assert schema["parameters"]["properties"]["direction"]["description"] == 'One of "up", "down", "left", "right".'
    system = ours.env.prompt(dataset(game)[0]["prompt"], ours.env.environments.tools())[0]["content"]
    assert f"step(direction: str) -> str: {schema['description']}" in system
    assert f"    direction: {schema['parameters']['properties']['direction']['description']}" in system
    # with the model's own tool calls, the template gets the very schema TRL gives it
    native = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, train_dataset=dataset(game),
                              args=our_config(tmp_path, tool_format="chat_template"),
                              environment_factory=game.GridWalkEnv)
    assert native.env.environments.template_tools[None] == [get_json_schema(t) for t in theirs.tools]


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
    ours = MTGRPOEnvTrainer(model=model_dir, reward_funcs=game.reward_walk, args=our_config(tmp_path),
                            train_dataset=dataset(game), environment_factory=Counted,
                            backend=ScriptedPolicy(tokenizer, {game.PROMPT: xml + [done]}))
    ours.train()
    assert [env.moves for env in ours.env.environments.free[None]] == [8, 8]
    stops = [h for h in ours.state.log_history if "loss" in h][0]
    assert stops["rollout/tool_calls_per_episode"] == 8 and stops["rollout/stop/no_action"] == 1.0


def test_no_default_of_the_knowledge_base_reaches_another_task(game, model_dir, tmp_path):
    """A `prompt` dataset with a tool, and an environment without a dataset: no search tool, no turn reward that
    reads `answer`, no word of question answering in the prompt; the advantage follows the signals given."""
    from datasets import Dataset

    from mt_grpo_trainer import MTGRPOEnvTrainer
    from tasks.fictional_kb import SEARCH_TASK_PROMPT

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
                              args=our_config(tmp_path, dataset_name=None))]
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
    from rewards.conversation import per_tool_turn
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
