"""verl 0.7.1's environments trained unchanged (adapters/verl.py): its GSM8K tool and GSM8K interaction, from their
own YAML files and a parquet written as verl's preprocessing scripts write it, train two steps from one constructor
field each; scripted episodes check each turn's credit (the tool's step rewards, the interaction's scores) and
the advantages by hand, finalize_interaction for every episode, compute_score's arguments; bad configs fail
naming the fix. The verl classes are the wheel's own files, shipped in mt_grpo/compat/verl (the package itself does
not import without torch distributed and ray): the adapter puts them on sys.path, as it does for a user without verl;
tests/fixtures/verl holds the configs and a user's module."""

import asyncio
import os
import sys
import types

import pytest
import torch

from helpers import ROOT, final_metrics, make_chat_template_agent, make_env, rollout_records, run
from scripted_policy import ScriptedPolicy

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "verl")
TOOL_CONFIG = os.path.join(FIXTURES, "gsm8k_tool_config.yaml")
INTERACTION_CONFIG = os.path.join(FIXTURES, "gsm8k_interaction_config.yaml")
# GSM8K's first two training questions, with their answers (verl's extract_solution of the "#### N" line)
QUESTIONS = {"72": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her "
                   "friends in May. How many clips did Natalia sell altogether in April and May?",
             "10": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
                   "much did she earn?"}
INSTRUCTION = "Let's think step by step and output the final answer after `####`."


@pytest.fixture(autouse=True)
def verl_on_path(monkeypatch):
    """verl (the copy in mt_grpo/compat, as the adapter provides it) and the user's module importable here and in
    the trainer's subprocess."""
    from mt_grpo.compat import provide

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # provide may add the copy's folder to it
    provide("verl")
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FIXTURES, ROOT, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def qwen_agent_dir(tiny_agent_dir, tmp_path_factory):
    """The tiny agent with Qwen2.5's chat template and tool-call tokens (untrained on them: the policy is scripted)."""
    return make_chat_template_agent(tiny_agent_dir, str(tmp_path_factory.mktemp("verl-qwen")), steps=0)


def verl_row(answer: str, index: int, interaction: str | None = None) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py (interaction=None) or
    gsm8k_multiturn_w_interaction.py writes it."""
    question = QUESTIONS.get(answer, f"What is {answer} plus 0?") + " " + INSTRUCTION
    system = ("You are a math expert. You are given a question and you need to solve it step by step. "
              + ("Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
                 "step by step solving the question, before generate final answer at least once and refine your "
                 "answer if necessary. " if interaction is None else
                 "You should rethinking carefully if user point out your answer is wrong. ")
              + "Put your final answer in the format of `#### <answer>`.")
    extra = {"split": "train", "index": index, "question": question}
    if interaction is None:
        extra.update(need_tools_kwargs=True,
                     tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
                     interaction_kwargs={"query": question, "ground_truth": answer})
    else:
        extra["interaction_kwargs"] = {"name": interaction, "query": question, "ground_truth": answer}
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": system},
                                                      {"role": "user", "content": question}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": extra}


def write_parquet(path, rows: list[dict]) -> str:
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def call(answer: str) -> str:
    from mt_grpo.base.protocol import ChatTemplateProtocol

    return ChatTemplateProtocol().format_call("calc_gsm8k_reward", {"answer": answer}) + "<|im_end|>"


def final(answer: str, why: str = "So the answer is") -> str:
    """A model turn without a tool call. A scripted variant's first turn must be its own (ScriptedPolicy finds the
    variant by it): `why` tells them apart."""
    return f"{why}\n#### {answer}<|im_end|>"


def adapted(tool_config=None, interaction_config=None, max_assistant_turns=None):
    from mt_grpo.adapters.verl import adapt

    return adapt(types.SimpleNamespace(verl_tool_config=tool_config, verl_interaction_config=interaction_config,
                                       verl_max_assistant_turns=max_assistant_turns, tool_timeout=10.0))


def verl_env(tokenizer, tool_config=None, interaction_config=None, max_assistant_turns=None, **overrides):
    """The trainer's env over the adapted class, chat_template protocol, no system prompt of ours; the limits the
    adapter brings applied as builders applies them."""
    from mt_grpo.rollout.environments import EnvironmentPool
    from mt_grpo.base.protocol import ChatTemplateProtocol
    from mt_grpo.run.builders import apply_settings

    protocol = ChatTemplateProtocol(tokenizer)
    parts = adapted(tool_config, interaction_config, max_assistant_turns)
    pool = EnvironmentPool(parts.environment_factory, [], protocol)
    settings = types.SimpleNamespace(**{"max_env_steps": 4, "max_completion_length": 600, "max_tokens_per_turn": 64,
                                        "task_prompt": None, "examples": None, "questions": False, **overrides})
    apply_settings(settings, parts.settings)  # a `prompt` column's rows, as builders sees them
    return make_env(tokenizer, pool.all_tools(), protocol=protocol, environments=pool, **vars(settings)), pool


def roll(env, rows, script):
    return env.rollout([env.prompt(row["prompt"]) for row in rows], ScriptedPolicy(env.tokenizer, script), rows=rows)


def turn_table(pool, episodes, rows):
    from mt_grpo_trainer import compute_rewards_per_func, turn_reward_table

    funcs = pool.reward_funcs[1]
    columns = {"environments": [ep.toolset.environment for ep in episodes]}
    turns = max(ep.tool_turns for ep in episodes)
    values = compute_rewards_per_func(funcs, ["p"] * len(rows), [ep.messages for ep in episodes], columns,
                                      [ep.tool_turns for ep in episodes], turns)
    return turn_reward_table(values, torch.ones(len(funcs)), torch.tensor([ep.tool_turns for ep in episodes]),
                                 [True] * len(funcs))


# -- the tool: scripted ------------------------------------------------------------------------------------
def test_the_gsm8k_tool_gives_each_turn_its_step_reward_and_the_advantages_by_hand(qwen_style_tokenizer):
    """verl 0.7.1 creates the tool's instance per call, so Gsm8kTool's step reward compares each answer with a
    fresh 0.0: 0.0 for a right answer, -0.05 for a wrong one. A: 72 (right). B: 70, then 72. The turn's R_T is the
    step reward; its schema is the YAML's, and the prompt is verl's, with no system prompt of ours."""
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
    from mt_grpo.rollout.episodes import pad_episodes

    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG)
    rows = [verl_row("72", 0)] * 2
    script = {"Natalia sold clips": [[call("72"), final("72")], [call("70"), call("72"), final("72")]]}
    b, a = roll(env, rows[::-1], {k: v[::-1] for k, v in script.items()})  # B first: its first call is not A's
    assert [m["content"] for m in a.messages if m["role"] == "tool"] == ["Current parsed answer='72' reward=1.0"]
    assert a.messages[-1]["content"] == b.messages[-1]["content"] == "So the answer is\n#### 72"
    assert [m["content"] for m in b.messages if m["role"] == "tool"] == ["Current parsed answer='70' reward=0.0",
                                                                         "Current parsed answer='72' reward=1.0"]
    # the YAML's schema as given to the template, and verl's own system prompt, first and alone
    text = qwen_style_tokenizer.decode(a.prompt_ids)
    assert '"description": "The model\'s answer to the GSM8K math problem, must be a digits"' in text
    assert text.startswith("<|im_start|>system\n" + rows[0]["prompt"][0]["content"] + "\n\n# Tools")
    assert a.toolset.environment.tool_rewards == [0.0] and b.toolset.environment.tool_rewards == [-0.05, 0.0]
    R_T = turn_table(pool, [a, b], rows)
    assert R_T[0, 0].item() == 0.0 and torch.isnan(R_T[0, 1]) and R_T[1, :2].tolist() == pytest.approx([-0.05, 0.0])
    # per_turn: the group's turns (0, -0.05, 0) pooled: mean -1/60, std (unbiased) 0.028868;
    # A_T = (0 + 1/60) / 0.028868 = 0.57735 for a right answer, -1.1547 for the wrong one
    turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][turns[0] == 0], torch.tensor(0.57735), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(-1.1547), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 1], torch.tensor(0.57735), atol=1e-4)


def test_compute_score_gets_verls_arguments(qwen_style_tokenizer):
    """compute_score(data_source, solution_str, ground_truth, extra_info) by dotted path: the whole response decoded
    without special tokens (tool turns included), reward_model.ground_truth, the row's extra_info with the
    episode's tool_rewards, turn_scores and num_turns; its dict's "score" is the reward, its other keys logged."""
    from mt_grpo.adapters import resolve_reward

    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG)
    rows = [verl_row("72", 0), verl_row("10", 1)]
    ep72, ep10 = roll(env, rows, {"Natalia sold clips": [call("70"), final("72")], "Weng earns": [final("12")]})
    # verl's custom_reward_function {path, name} as `path:name`
    reward = resolve_reward(os.path.join(FIXTURES, "user_verl.py") + ":compute_score")
    assert reward.__name__ == "compute_score"
    reward.tokenizer = qwen_style_tokenizer  # as builders.assemble sets it
    logged, scored = {}, reward.verl_compute_score.__globals__["SCORED"]
    values = reward(prompts=["a", "b"], completions=[ep72.messages, ep10.messages],
                    completion_ids=[ep72.completion_ids, ep10.completion_ids],
                    environments=[ep72.toolset.environment, ep10.toolset.environment],
                    log_extra=lambda column, v: logged.update({column: v}),
                    **{k: [r[k] for r in rows] for k in ("data_source", "reward_model", "extra_info", "ability")})
    assert values == [1.0, 0.0] and logged == {"compute_score/turns": [4, 2]}
    first, second = scored
    assert first["solution_str"] == qwen_style_tokenizer.decode(ep72.completion_ids, skip_special_tokens=True)
    assert "Current parsed answer='70'" in first["solution_str"] and first["solution_str"].endswith("#### 72")
    assert (first["data_source"], first["ground_truth"], second["ground_truth"]) == ("openai/gsm8k", "72", "10")
    info = first["extra_info"]
    assert info["tools_kwargs"] == rows[0]["extra_info"]["tools_kwargs"] and info["index"] == 0
    assert (info["tool_rewards"], info["turn_scores"], info["num_turns"]) == ([-0.05], [], 4)


# -- the interaction: scripted ---------------------------------------------------------------------------
def test_the_gsm8k_interaction_answers_as_the_user_and_scores_each_turn(qwen_style_tokenizer):
    """A wrong answer gets Gsm8kInteraction's feedback as a user turn and a score of 0; a right one its "correct"
    reply and the end of the episode. Each model turn's R_T is its score; the advantages by hand."""
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
    from mt_grpo.rollout.episodes import pad_episodes

    env, pool = verl_env(qwen_style_tokenizer, interaction_config=INTERACTION_CONFIG)
    rows = [verl_row("72", 0, interaction="gsm8k")] * 2
    script = {"Natalia sold clips": [[final("72", "A:")], [final("70", "B:"), final("72")]]}
    a, b = roll(env, rows, script)
    users = lambda ep: [m["content"] for m in ep.messages if m["role"] == "user"]  # noqa: E731
    assert users(a) == ["Your response is correct!"]
    assert users(b) == ["Your response is incorrect! You need to reflect on your answer and try again.",
                        "Your response is correct!"]
    assert [m["role"] for m in b.messages] == ["assistant", "user", "assistant", "user"]  # done: reply, then end
    assert b.toolset.environment.turn_scores == [0.0, 1.0]
    R_T = turn_table(pool, [a, b], rows)
    assert R_T[0, 0].item() == 1.0 and R_T[1, :2].tolist() == [0.0, 1.0]
    # per_turn: (1, 0, 1) pooled: mean 2/3, std (unbiased) 0.57735; A_T = +0.57735 (right), -1.1547 (wrong)
    turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][turns[0] == 0], torch.tensor(0.57735), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(-1.1547), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 1], torch.tensor(0.57735), atol=1e-4)


def test_tools_and_an_interaction_in_one_environment(qwen_style_tokenizer):
    """Both configs: one class; a tool turn's R_T is its step reward, the answer's the interaction's score."""
    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG, INTERACTION_CONFIG)
    row = verl_row("72", 0, interaction="gsm8k")
    row["extra_info"]["tools_kwargs"] = verl_row("72", 0)["extra_info"]["tools_kwargs"]
    ep, = roll(env, [row], {"Natalia sold clips": [call("70"), final("72")]})
    assert [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant", "user"]
    assert ep.messages[-1]["content"] == "Your response is correct!"
    assert turn_table(pool, [ep], [row])[0].tolist() == pytest.approx([-0.05, 1.0])


def test_finalize_interaction_runs_for_every_episode_even_one_that_raised(qwen_style_tokenizer, tmp_path):
    """A user's interaction (subclassing verl's BaseInteraction) whose generate_response raises for one row: that
    episode ends on the error, and every episode's interaction is finalized once, with its own request id."""
    import user_verl

    config = tmp_path / "interaction.yaml"
    config.write_text("interaction:\n  - name: flaky\n    class_name: user_verl.FlakyInteraction\n    config: {}\n")
    env, pool = verl_env(qwen_style_tokenizer, interaction_config=str(config))
    user_verl.STARTED.clear(), user_verl.FINALIZED.clear()
    rows = [verl_row("72", 0, interaction="flaky"), verl_row("raise", 1, interaction="flaky")]
    rows[1]["prompt"][1]["content"] = "Explode. " + INSTRUCTION
    ok, raised = roll(env, rows, {"Natalia sold clips": [final("72")], "Explode.": [final("1")]})
    env.release([ok, raised])
    assert [m["content"] for m in ok.messages if m["role"] == "user"] == ["Correct."]
    assert [m["role"] for m in raised.messages] == ["assistant"]  # no reply: the episode ended on the error
    assert len(user_verl.STARTED) == 2 and sorted(user_verl.FINALIZED) == sorted(user_verl.STARTED)
    interaction = pool.free[None][0]._verl_interactions["flaky"]
    assert interaction._instance_dict == {}  # each finalize released its state


# -- verl's turn limits and per-turn behaviour ---------------------------------------------------------------------
def unknown_call(name: str = "calc_gsm8k") -> str:
    from mt_grpo.base.protocol import ChatTemplateProtocol

    return ChatTemplateProtocol().format_call(name, {"answer": "72"}) + "<|im_end|>"


def test_max_assistant_turns_ends_the_episode_on_its_last_model_turn(qwen_style_tokenizer, tmp_path):
    """verl_max_assistant_turns (verl's multi_turn.max_assistant_turns) 2, tools: verl ends the episode after the
    model's 2nd turn, before it parses it. A: 70 (-0.05), then a call of 72 that is not run (max_assistant_turns);
    B: 72 (0.0), then its answer (no_action: the cap ended nothing). Turns the interaction answers count too: cap 3,
    tool and interaction: A's answer at turn 3 gets no reply (Gsm8kInteraction would have said correct, 1.0)."""
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
    from mt_grpo.rollout.episodes import pad_episodes

    assert adapted(TOOL_CONFIG, max_assistant_turns=2).settings == {"max_env_steps": 1}  # the cap's calls held back
    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG, max_assistant_turns=2)
    rows = [verl_row("72", 0)] * 2
    a, b = roll(env, rows, {"Natalia sold clips": [[call("70"), call("72"), final("72")], [call("72"), final("72")]]})
    assert [m["role"] for m in a.messages] == ["assistant", "tool", "assistant"]  # the 2nd call: not run
    assert (a.stop_reason, b.stop_reason) == ("max_assistant_turns", "no_action")
    assert a.toolset.environment.tool_rewards == [-0.05] and b.toolset.environment.tool_rewards == [0.0]
    R_T = turn_table(pool, [a, b], rows)
    assert R_T[:, 0].tolist() == pytest.approx([-0.05, 0.0])
    # per_turn: the group's turns (-0.05, 0) pooled: mean -0.025, std (unbiased) 0.035355; A_T = -/+0.70711
    turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][turns[0] == 0], torch.tensor(-0.70711), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(0.70711), atol=1e-4)
    assert torch.all(adv.tokens[0][turns[0] == 1] == 0.0)  # the turn that ended it has no score (no outcome here)

    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG, INTERACTION_CONFIG, max_assistant_turns=3)
    row = verl_row("72", 0, interaction="gsm8k")
    row["extra_info"]["tools_kwargs"] = verl_row("72", 0)["extra_info"]["tools_kwargs"]
    ep, = roll(env, [row], {"Natalia sold clips": [call("70"), final("70"), final("72")]})
    assert [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert ep.stop_reason == "max_assistant_turns" and ep.toolset.environment.turn_scores == [0]
    assert turn_table(pool, [ep], [row])[0, :2].tolist() == pytest.approx([-0.05, 0.0])
    from mt_grpo_trainer import MTGRPOConfig

    with pytest.raises(ValueError, match="`verl_max_assistant_turns` takes an integer ≥ 1 or null; the config gave 0"):
        MTGRPOConfig(output_dir=str(tmp_path), verl_tool_config=TOOL_CONFIG, verl_max_assistant_turns=0)
    with pytest.raises(ValueError, match="neither `verl_tool_config` nor `verl_interaction_config` is"):
        adapted(max_assistant_turns=2)


def test_a_turn_cut_by_max_tokens_per_turn_gets_the_interactions_reply(qwen_style_tokenizer):
    """verl has no per-turn cap: its loop answers every turn that leaves budget. A's first turn is cut by
    max_tokens_per_turn before its `#### 72`: Gsm8kInteraction reads the cut text (incorrect, 0) and A answers again,
    right (1.0); B is right at once (1.0). R_T A [0, 1], B [1]; A_T by hand. A cut turn that holds a tool call ends
    the episode there, its call not run (turn_length; verl would run it: the guide says so)."""
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
    from mt_grpo.rollout.episodes import pad_episodes

    env, pool = verl_env(qwen_style_tokenizer, interaction_config=INTERACTION_CONFIG, max_tokens_per_turn=16)
    rows = [verl_row("72", 0, interaction="gsm8k")] * 2
    long = "A: let me think it through step by step, month by month, adding what she sold in each month.\n#### 72"
    a, = roll(env, rows[:1], {"Natalia sold clips": [long + "<|im_end|>", final("72")]})  # a cut turn is no
    b, = roll(env, rows[1:], {"Natalia sold clips": [final("72", "B:")]})  # script variant's key: one group in two
    assert len(a.completion_ids[a.spans[0].start:a.spans[0].end]) == 16 and "####" not in a.messages[0]["content"]
    assert [m["content"] for m in a.messages if m["role"] == "user"] == [
        "Your response is incorrect! You need to reflect on your answer and try again.", "Your response is correct!"]
    assert (a.stop_reason, b.stop_reason) == ("env_done", "env_done") and a.toolset.environment.turn_scores == [0, 1]
    R_T = turn_table(pool, [a, b], rows)
    assert R_T[0, :2].tolist() == [0.0, 1.0] and R_T[1, 0].item() == 1.0
    # per_turn: (0, 1, 1) pooled: mean 2/3, std (unbiased) 0.57735; A_T = -1.1547 (cut, wrong), +0.57735 (right)
    turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][turns[0] == 0], torch.tensor(-1.1547), atol=1e-4)
    assert torch.allclose(adv.tokens[0][turns[0] == 1], torch.tensor(0.57735), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(0.57735), atol=1e-4)

    whole_call = call("72")[:-len("<|im_end|>")] + "\n"  # the call, then text the cap cuts
    cap = len(qwen_style_tokenizer.encode(whole_call, add_special_tokens=False)) + 4
    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG, INTERACTION_CONFIG, max_tokens_per_turn=cap)
    row = verl_row("72", 0, interaction="gsm8k")
    row["extra_info"]["tools_kwargs"] = verl_row("72", 0)["extra_info"]["tools_kwargs"]
    ep, = roll(env, [row], {"Natalia sold clips": [whole_call + long, final("72")]})
    assert ep.messages[0]["tool_calls"] and [m["role"] for m in ep.messages] == ["assistant"]
    assert ep.stop_reason == "turn_length" and ep.toolset.environment.tool_rewards == []


def test_an_unknown_tool_gets_verls_0_in_tool_rewards(qwen_style_tokenizer):
    """verl's _call_tool answers a name it has no tool for (a KeyError) with its error text and appends 0.0 to
    tool_rewards. A calls `calc_gsm8k` (no such tool): 0.0, its turn's R_T; B calls the tool with 70: -0.05.
    Pooled (0, -0.05): A_T = +/-0.70711."""
    from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
    from mt_grpo.rollout.episodes import pad_episodes

    env, pool = verl_env(qwen_style_tokenizer, TOOL_CONFIG)
    rows = [verl_row("72", 0)] * 2
    a, b = roll(env, rows, {"Natalia sold clips": [[unknown_call(), final("72")], [call("70"), final("72")]]})
    replies = [m["content"] for m in a.messages if m["role"] == "tool"]
    assert replies[0] == "{'error': 'Tool calc_gsm8k not found.'}"  # the trainer's text: TRL's, under chat_template
    assert a.toolset.environment.tool_rewards == [0.0] and b.toolset.environment.tool_rewards == [-0.05]
    R_T = turn_table(pool, [a, b], rows)
    assert R_T[:, 0].tolist() == pytest.approx([0.0, -0.05])
    turns = pad_episodes([a, b], 0, False)["token_turns"]
    adv = mt_grpo_advantages(R_T, torch.zeros(2), turns, AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    assert torch.allclose(adv.tokens[0][turns[0] == 0], torch.tensor(0.70711), atol=1e-4)
    assert torch.allclose(adv.tokens[1][turns[1] == 0], torch.tensor(-0.70711), atol=1e-4)


SLEEPY_CONFIG = """tools:
  - class_name: user_verl.SleepyTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: nap
        description: Sleep for some seconds.
        parameters: {type: object, properties: {seconds: {type: number, description: how long}}, required: [seconds]}
"""


def test_an_execute_that_blocks_its_loop_stalls_only_its_own_episode(tmp_path):
    """Episode A's `execute` blocks its event loop with `time.sleep(60)`: A's call times out; B's call, made beside
    it, and C's, made after A was given up, answer at once with their rewards (on one shared verl loop both timed
    out, and so did every later verl call of the run)."""
    from mt_grpo.base.protocol import ToolCall, XMLProtocol
    from mt_grpo.rollout.environments import EnvironmentPool
    from mt_grpo.rollout.toolset import run_turns

    config = tmp_path / "tool_config.yaml"
    config.write_text(SLEEPY_CONFIG)
    pool = EnvironmentPool(adapted(tool_config=str(config)).environment_factory, [], XMLProtocol())
    start = lambda: pool.start([{"prompt": "Nap.", "row": 0}], [[{"role": "user", "content": "Nap."}]])[1][0]  # noqa
    a, b = start(), start()
    nap = lambda seconds: [ToolCall(name="nap", arguments={"seconds": seconds})]  # noqa: E731
    (stalled,), (answered,) = run_turns([(a, nap(60)), (b, nap(0))], timeout=5.0, max_workers=4)
    assert not stalled.ok and "timed out" in stalled.output
    assert answered.ok and answered.output == "slept 0" and b.turn_rewards == [[1.0]]
    c = start()
    (later,), = run_turns([(c, nap(0))], timeout=5.0, max_workers=4)
    assert later.ok and later.output == "slept 0" and c.turn_rewards == [[1.0]]
    assert a.environment.tool_rewards == [] and c.environment.tool_rewards == [1.0]


ZOOM_CONFIG = """tools:
  - class_name: user_verl.ZoomTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: zoom
        description: Zoom into the picture.
        parameters: {type: object, properties: {x: {type: integer, description: "Where to zoom, from 1 to 9."}}, required: [x]}
"""


def test_a_tool_response_with_an_image_reaches_the_model_as_its_tool_message(tmp_path):
    """verl 0.7.1's multimodal tool message: ToolResponse(image=[crop], text=...) is the tool message's image, then
    its text (engine/vision.py's blocks), with the step reward verl appends to tool_rewards; a video is refused."""
    from PIL import Image

    from mt_grpo.base.protocol import ToolCall, XMLProtocol
    from mt_grpo.rollout.environments import EnvironmentPool
    from mt_grpo.rollout.toolset import run_turns

    config = tmp_path / "tool_config.yaml"
    config.write_text(ZOOM_CONFIG)
    pool = EnvironmentPool(adapted(tool_config=str(config)).environment_factory, [], XMLProtocol())
    toolset = pool.start([{"prompt": "Zoom.", "row": 0}], [[{"role": "user", "content": "Zoom."}]])[1][0]
    (result,), = run_turns([(toolset, [ToolCall(name="zoom", arguments={"x": 2})])], timeout=10.0, max_workers=2)
    assert result.ok
    image, text = result.output
    assert isinstance(image["image"], Image.Image) and image["image"].size == (56, 84) and image["type"] == "image"
    assert text == {"type": "text", "text": "Zoomed in at 2."}
    assert toolset.turn_rewards == [[0.5]] and toolset.environment.tool_rewards == [0.5]
    (video,), = run_turns([(toolset, [ToolCall(name="zoom", arguments={"x": -1})])], timeout=10.0, max_workers=2)
    assert not video.ok and "returned a ToolResponse with a video: videos are not supported" in video.output


def digit_rows(count: int) -> list[dict]:
    """verl's multimodal rows (geo3k's preprocessing form): the picture in `images`, `<image>` where it sits."""
    from PIL import Image, ImageDraw

    def digit(n):
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).text((22, 20), str(n), fill="black")
        return image

    return [{"data_source": "digits", "prompt": [{"role": "user", "content": "<image>Which number is drawn?"}],
             "images": [digit(i)], "ability": "vision", "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"index": i}} for i in range(count)]


def test_a_verl_dataset_with_images_becomes_prompts_with_the_images_where_their_tags_were(tmp_path):
    """geo3k's form: the `<image>` tags that open the first user message leave its text, and the row's `images` go
    there (TRL's `images` column); a parquet without `images` is read as usual; a tag elsewhere, a count of tags
    other than the images, or a `<video>` is refused naming the row."""
    from mt_grpo.adapters.verl import verl_image_dataset
    from mt_grpo.engine.vision import prompt_with_images, row_image_column

    data = verl_image_dataset(write_parquet(tmp_path / "digits.parquet", digit_rows(2)))
    row = data[1]
    assert row["prompt"] == [{"role": "user", "content": "Which number is drawn?"}]
    (message,) = prompt_with_images(row["prompt"], row_image_column(row))
    image, text = message["content"]
    assert image["image"].size == (56, 56) and text == {"type": "text", "text": "Which number is drawn?"}
    assert verl_image_dataset(write_parquet(tmp_path / "text.parquet", [verl_row("72", 0)])) is None
    for content, message in (("Which <image> number?", "0 `<image>` tags at the start .* for its 1 images, and more "
                              "elsewhere"), ("<image><image>Which?", "2 `<image>` tags"),
                             ("<image><video>Which?", "1 `<image>` tags .* and a <video> \\(videos are not supported\\)")):
        rows = digit_rows(1)
        rows[0]["prompt"][0]["content"] = content
        with pytest.raises(ValueError, match=f"Row 0 of .*: its prompt has {message}"):
            verl_image_dataset(write_parquet(tmp_path / "bad.parquet", rows))


def test_a_zoom_tool_and_a_dataset_with_images_train_a_vision_model_two_steps(tmp_path, tmp_path_factory):
    """verl's parquet of pictures and a tool config whose ToolResponse holds a crop, from the recipe fields, on the
    tiny Qwen2-VL taught to call zoom (sampled in process): two steps; the records hold the row's picture in the
    prompt and the crops in the tool turns, and the tool's 0.5 as each call's R_T."""
    from conftest import shared_folder
    from prepare_models import make_tiny_vlm_agent

    model = shared_folder(tmp_path_factory, "tiny-vl-agent-qwen2_vl", lambda out: make_tiny_vlm_agent(out, "qwen2_vl"))
    config = tmp_path / "zoom_config.yaml"
    config.write_text(ZOOM_CONFIG)
    out = str(tmp_path / "out")
    data = write_parquet(tmp_path / "digits.parquet", digit_rows(8))
    code = f"""
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer

def correct(completions, reward_model, **kwargs):
    return [1.0 if r["ground_truth"] in str(c[-1]["content"]) else 0.0 for c, r in zip(completions, reward_model)]

args = MTGRPOConfig(output_dir={out!r}, dataset_name={data!r}, verl_tool_config={str(config)!r}, max_steps=2,
                    num_generations=2, per_device_train_batch_size=4, max_completion_length=160, learning_rate=1e-3,
                    use_cpu=True, bf16=False, logging_steps=1, report_to="none", save_strategy="no",
                    save_rollouts_steps=1, disable_tqdm=True)
MTGRPOEnvTrainer({model!r}, args=args, reward_funcs=correct).train()
"""
    run([sys.executable, "-c", code], tmp_path)
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in steps)
    assert "rewards/turn/VerlEnvironment_steps" in steps[0]
    records = rollout_records(out)
    assert all(len(r["prompt_images"]) == 1 and r["prompt_images"][0]["size"] == [56, 56] for r in records)
    called = [r for r in records if any(t["role"] == "env" and t.get("images") for t in r["turns"])]
    assert called, "the tiny VLM agent should call zoom"
    assert all(r["R_T"][0] == 0.5 for r in called)


# -- training, from the constructor field ----------------------------------------------------------------------
TRAIN = """
import sys
from mt_grpo_trainer import MTGRPOConfig, MTGRPOEnvTrainer
sys.path.insert(0, "tests")
from scripted_policy import ScriptedTransformersBackend
script = {script!r}
args = MTGRPOConfig(output_dir={out!r}, dataset_name={data!r}, {field}={config!r}, tool_format="chat_template",
                    outcome_reward_funcs=["verl.utils.reward_score.default_compute_score"],
                    max_steps=2, num_generations=4, per_device_train_batch_size=4, max_completion_length=512,
                    max_tokens_per_turn=64, max_tool_response_tokens=32, use_cpu=True, bf16=False, report_to="none",
                    save_strategy="no", learning_rate=1e-3, logging_steps=1, disable_tqdm=True,
                    save_rollouts_steps=1, max_env_steps=3, eval_strategy="no", max_prompt_length=4096{more})
trainer = MTGRPOEnvTrainer({model!r}, args=args, backend=lambda env: ScriptedTransformersBackend(env.tokenizer, script))
trainer.train()
trainer.save_state()
"""


def train(tmp_path, model_dir, field, config, rows, script, **more):
    out = str(tmp_path / "out")
    data = write_parquet(tmp_path / "train.parquet", rows)
    more = "".join(f", {k}={v!r}" for k, v in more.items())
    run([sys.executable, "-c", TRAIN.format(script=script, out=out, data=data, field=field, config=config,
                                            model=model_dir, more=more)], tmp_path)
    records = rollout_records(out) + rollout_records(out, "step-000002.jsonl")
    return [h for h in final_metrics(out) if "loss" in h], records


def test_the_gsm8k_tool_trains_two_steps_from_its_yaml(qwen_agent_dir, tmp_path):
    """verl's gsm8k_tool_config.yaml and a parquet of verl's gsm8k_multiturn_w_tool rows: two steps; the tool's
    step rewards are each turn's R_T, default_compute_score the outcome."""
    script = {"Natalia sold clips": [[call("70"), call("72"), final("72")], [call("72"), final("72")],
                                     [call("71"), final("71")], [final("72", "Done:")]],
              "Weng earns": [[call("10"), final("10")], [final("10", "A:")], [final("12", "B:")],
                             [call("12"), final("12")]]}
    steps, records = train(tmp_path, qwen_agent_dir, "verl_tool_config", TOOL_CONFIG,
                           [verl_row("72", 0), verl_row("10", 1)], script)
    assert len(steps) == 2
    assert "rewards/outcome/default_compute_score" in steps[0] and "rewards/turn/VerlEnvironment_steps" in steps[0]
    natalia = [r for r in records if "Natalia" in r["prompt_text"]]
    assert [r["R_T"] for r in natalia] == [pytest.approx([-0.05, 0.0]), [0.0], pytest.approx([-0.05]), [0.0]]
    assert [r["R_O"] for r in natalia] == [1.0, 1.0, 0.0, 1.0]
    assert [r["stop_reason"] for r in natalia] == ["no_action"] * 4
    # verl's prompt as the row has it: its own system message, none of ours (no <answer> format asked)
    assert natalia[0]["prompt_text"].startswith("<|im_start|>system\nYou are a math expert. You are given")
    prompt = natalia[0]["prompt_text"]
    assert "`#### <answer>`.\n\n# Tools" in prompt and "inside <answer> </answer>" not in prompt
    assert prompt.count("<|im_start|>") == 3  # system, the question, the generation prompt: no worked example


def test_the_gsm8k_interaction_trains_two_steps_from_its_yaml(qwen_agent_dir, tmp_path):
    """verl's gsm8k interaction config and a parquet of gsm8k_multiturn_w_interaction rows: two steps; each model
    turn's R_T is the interaction's score, A_T by hand."""
    script = {"Natalia sold clips": [[final("72", "A:")], [final("70", "B:"), final("72")],
                                     [final("70", "C:"), final("71"), final("72")],
                                     [final("1", "D:"), final("2"), final("3"), final("4")]],
              "Weng earns": [[final("10", "A:")], [final("12", "B:"), final("10")], [final("10", "C:")],
                             [final("10", "D:")]]}
    steps, records = train(tmp_path, qwen_agent_dir, "verl_interaction_config", INTERACTION_CONFIG,
                           [verl_row("72", 0, "gsm8k"), verl_row("10", 1, "gsm8k")], script, max_user_turns=3)
    assert len(steps) == 2 and "rewards/turn/VerlEnvironment_steps" in steps[0]
    natalia = [r for r in records if "Natalia" in r["prompt_text"]]
    # D's fourth answer gets no reply (max_user_turns=3, as verl's multi_turn.max_user_turns): no turn reward
    assert [r["R_T"] for r in natalia] == [[1.0], [0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    assert [r["stop_reason"] for r in natalia] == ["env_done"] * 3 + ["no_action"]
    pooled = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    mean = sum(pooled) / len(pooled)
    std = (sum((x - mean) ** 2 for x in pooled) / (len(pooled) - 1)) ** 0.5
    assert [r["A_T"] for r in natalia] == [[pytest.approx((x - mean) / std) for x in r["R_T"]] for r in natalia]


# -- mistakes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.NoSuchTool\n    config: {type: native}\n    tool_schema: {}\n",
     "has no class 'NoSuchTool'"),
    ("tools:\n  - class_name: no_such_package.Tool\n    config: {type: native}\n", "does not import"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n", "has no `tool_schema`"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n    tool_schema:\n"
     "      type: function\n      function: {name: calc}\n", "not an OpenAI function schema"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: sandbox}\n", "not a verl tool type"),
    ("tools: []\n", "has no `tools:` list"),
    ("interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n  - class_name: "
     "verl.interactions.gsm8k_interaction.Gsm8kInteraction\n", "name 'gsm8k' is used twice"),
])
def test_bad_configs_fail_naming_the_fix(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    field = "interaction_config" if text.startswith("interaction") else "tool_config"
    with pytest.raises(ValueError, match=message):
        adapted(**{field: str(path)})


def test_a_row_naming_an_unknown_interaction_fails_naming_the_fix():
    env_class = adapted(interaction_config=INTERACTION_CONFIG).environment_factory
    with pytest.raises(ValueError, match=r"'math_tutor', which verl_interaction_config does not define.*\['gsm8k'\]"):
        asyncio.run(env_class().reset(**verl_row("72", 0, interaction="math_tutor")))
    with pytest.raises(ValueError, match="requires one: give each row `extra_info.interaction_kwargs.name`"):
        asyncio.run(env_class().reset(**verl_row("72", 0)))  # the tool rows have interaction_kwargs without a name
    with pytest.raises(ValueError, match="is not a file"):
        adapted(tool_config="no/such/tool_config.yaml")


def test_an_mcp_entry_serves_its_selected_tools(tmp_path):
    """verl's mcp_tool_config.yaml form: `config.type: mcp`, the servers of an mcpServers JSON, `tool_selected_list`;
    the server's tools join the run's tools with their own schema, and a call returns the server's text."""
    from mt_grpo.tasks.fictional_kb import build_fictional_kb
    from mt_grpo.tools import mcp
    from mt_grpo.tools.search import make_search_tool

    if not hasattr(mcp, "mcp_tools_from_map"):  # the mcpServers map lands on main from the `mcpfix` branch
        pytest.skip("mt_grpo.tools.mcp.mcp_tools_from_map is not on this branch yet")

    servers = tmp_path / "mcp_server.json"
    servers.write_text('{"mcpServers": {"kb": {"command": "python", "args": ["mt_grpo/tools/kb_mcp_server.py", "--seed", '
                       '"0", "--crashable"]}}}')
    config = tmp_path / "mcp_tool_config.yaml"
    config.write_text("tools:\n  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n    config:\n"
                      "      rate_limit: 120\n      timeout: 120\n      type: mcp\n    mcp:\n"
                      f"      mcp_servers_config_path: {servers}\n      tool_selected_list:\n        - search\n")
    try:
        result = adapted(str(config))
        assert result.environment_factory is None and [fn.__name__ for fn in result.tools] == ["search"]
        assert result.tools[0].json_schema["function"]["name"] == "search"
        local = make_search_tool(build_fictional_kb(seed=0)[0])  # the server serves this search (--crashable adds two
        assert result.tools[0](query="capital of Ratomora") == local(query="capital of Ratomora")  # tools: dropped)
    finally:
        mcp.close_mcp_servers()
