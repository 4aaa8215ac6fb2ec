"""The chat_template protocol end to end (issue 13): scripted episodes through Qwen2.5's and Qwen3's real chat
templates with exact masks, the tokenization check, the rewards on the canonical messages, the MT-GRPO split,
a 2-step training run on CPU, and the 7B recipe's launch command. Parsing, tool schemas and the rules of a
Qwen3 re-render are in test_protocol.py; the run against a live vLLM server is in test_vllm_server.py.

The tokenizers are the tiny one with a Qwen template and the tokens the real Qwen tokenizers add as
non-special added tokens, so that `<tool_call>` or `</think>` is one id, never merged with its neighbours,
and is kept by `decode(skip_special_tokens=True)`, as with the real ones. Every scripted turn ends with
`<|im_end|>`, as a Qwen model ends its turns (the chat_template protocol has no stop string).
"""

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from helpers import (CHAT_TEMPLATE_FLAGS, EMPTY_THINK, RECIPE, ROOT, TEMPLATE_FILES, VELTRIA, changed_parameters,
                     fake_search, final_metrics, make_chat_template_agent, make_env, qwen_tokenizer, rollout_records,
                     run, template_call)
from mt_grpo_trainer import AdvantageSettings, mt_grpo_advantages
from mt_grpo.rollout.episodes import pad_episodes, result_start, token_turn_index
from mt_grpo.base.protocol import ChatTemplateProtocol, XMLProtocol
from mt_grpo.run.reporting import episode_stats, rollout_metrics
from scripted_policy import ScriptedPolicy


@dataclass
class Setup:
    template: str
    chat_template_kwargs: dict
    thinking: bool  # the scripted turns open with a thought laid out as the template re-renders one

    @property
    def thinking_off(self) -> bool:
        """Qwen3's generation prompts pre-write an empty think block (mask 0) before every sampled turn."""
        return self.chat_template_kwargs.get("enable_thinking") is False


SETUPS = {"qwen2.5": Setup("qwen2.5", {}, False),
          "qwen3-thinking": Setup("qwen3", {}, True),  # the template's default: thinking on
          "qwen3-no-thinking": Setup("qwen3", {"enable_thinking": False}, False)}


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir):
    return {name: qwen_tokenizer(tiny_model_dir, name) for name in TEMPLATE_FILES}


# ------------------------------------------------------------------------------------------------
# the tool and the script
# ------------------------------------------------------------------------------------------------
FACTS = {"capital of Veltria": VELTRIA, "Quorvath founded": "Quorvath: Quorvath is a city founded in 1740."}
AFTER = {"Quorvath founded": "capital of Veltria"}  # this call comes first in its turn and waits for the other


def make_search(log: list):
    """The search tool of these episodes: it answers from FACTS (a Quorvath search once a Veltria search has
    finished: AFTER), and appends (query, start, end) to `log` for every call it runs."""
    return fake_search(lambda query: FACTS.get(query, f"No documents match the query {query!r}."), AFTER, log)


ONE = template_call("capital of Veltria")
TWO = template_call("Quorvath founded") + "\n" + template_call("capital of Veltria")
BAD_JSON = '<tool_call>\n{"name": "search", "arguments": {"query": }}\n</tool_call>'
# question -> (thought, visible text) of each model turn
PLAN = {
    "Q-one": [("I look it up.", "Let me search.\n" + ONE), ("Found it.", "<answer>Morvane</answer>")],
    "Q-two": [("I need two facts.", "I look up both.\n" + TWO),
              ("Both found.", "Founded in 1740; the capital is Morvane.\n<answer>1740, Morvane</answer>")],
    "Q-malformed": [("I try three calls.",
                     BAD_JSON + "\n" + template_call("Quorvath founded", name="lookup") + "\n" + ONE),
                    ("One worked.", "<answer>Morvane</answer>")],
    "Q-silent": [("Hmm.", "I am not sure.")],
    # max_env_steps=2: the third turn's call is sampled but not run
    "Q-again": [("Search.", ONE), ("Again.", ONE), ("Once more.", ONE)],
}
STOP = {"Q-one": "answer", "Q-two": "answer", "Q-malformed": "answer", "Q-silent": "no_action",
        "Q-again": "max_env_steps"}
V, Q = {"query": "capital of Veltria"}, {"query": "Quorvath founded"}
CALLS = {  # each assistant message's `tool_calls` (name, arguments): the calls that parsed, run or not
    "Q-one": [[("search", V)], []],
    "Q-two": [[("search", Q), ("search", V)], []],
    "Q-malformed": [[("lookup", Q), ("search", V)], []],
    "Q-silent": [[]],
    "Q-again": [[("search", V)]] * 3,
}
RESULTS = {  # the tool messages (name, content) after each tool turn
    "Q-one": [[("search", FACTS["capital of Veltria"])]],
    "Q-two": [[("search", FACTS["Quorvath founded"]), ("search", FACTS["capital of Veltria"])]],
    # a name no tool has reads as TRL's loop writes it; a call that did not parse (TRL has none) as ours
    "Q-malformed": [[("", "Error: the tool call is not valid JSON (Expecting value at char 43)."),
                     ("lookup", "{'error': 'Tool lookup not found.'}"),
                     ("search", FACTS["capital of Veltria"])]],
    "Q-silent": [],
    "Q-again": [[("search", FACTS["capital of Veltria"])]] * 2,
}


def turn(setup: Setup, thought: str, text: str) -> str:
    """A sampled turn: Qwen3 with thinking on writes `<think>\\nR\\n</think>\\n\\n` first (the layout its
    template re-renders); every turn ends with the end-of-turn token the model samples."""
    return (f"<think>\n{thought}\n</think>\n\n" if setup.thinking else "") + text + "<|im_end|>"


def script(setup: Setup, plan: dict = PLAN) -> dict[str, list[str]]:
    return {q: [turn(setup, thought, text) for thought, text in turns] for q, turns in plan.items()}


def setup_env(tokenizer, setup: Setup, tools: list, **overrides):
    """The chat_template environment of `setup`: helpers.make_env with longer turns, and few-shot turns."""
    kwargs = dict(max_tokens_per_turn=200, max_completion_length=800, few_shot=True,
                  chat_template_kwargs=setup.chat_template_kwargs)
    kwargs.update(overrides)
    return make_env(tokenizer, tools, ChatTemplateProtocol(tokenizer), **kwargs)


def roll_out(tokenizers, setup: Setup, plan: dict = PLAN, **overrides):
    """(tokenizer, env, questions, episodes, tool call log) of one batch with every question of `plan`."""
    tokenizer, log = tokenizers[setup.template], []
    env = setup_env(tokenizer, setup, [make_search(log)], **overrides)
    questions = list(plan)
    episodes = env.rollout([env.prompt(q) for q in questions], ScriptedPolicy(tokenizer, script(setup, plan)))
    return tokenizer, env, questions, episodes, log


def reply(setup: Setup, results: list[tuple[str, str]]) -> str:
    """The template's text after a tool turn (both templates write the same): the model's own <|im_end|>
    ended its turn, so the reply opens with the newline after it."""
    body = "".join(f"\n<tool_response>\n{content}\n</tool_response>" for _, content in results)
    after = EMPTY_THINK if setup.thinking_off else ""
    return "\n<|im_start|>user" + body + "<|im_end|>\n<|im_start|>assistant\n" + after


@pytest.fixture(scope="module", params=list(SETUPS))
def rollout(request, tokenizers):
    setup = SETUPS[request.param]
    return (setup, *roll_out(tokenizers, setup))


# ------------------------------------------------------------------------------------------------
# episodes: masks, replies, messages, stop reasons, the tokenization check
# ------------------------------------------------------------------------------------------------
def test_masks_spans_and_texts(rollout):
    """Mask 1 decodes to the sampled turns, mask 0 to the template's replies; the canonical messages; stop reasons."""
    setup, tokenizer, env, questions, episodes, _ = rollout
    sampled = script(setup)
    for q, ep in zip(questions, episodes):
        assert ep.stop_reason == STOP[q], q
        assert ep.spans[0].start == 0 and ep.spans[-1].end == len(ep.completion_ids)
        assert all(a.end == b.start and a.role != b.role for a, b in zip(ep.spans, ep.spans[1:]))
        model_spans = [s for s in ep.spans if s.role == "model"]
        env_spans = [s for s in ep.spans if s.role == "env"]
        assert len(model_spans) == len(sampled[q]) and len(env_spans) == len(RESULTS[q]) == ep.tool_turns
        # mask 1: exactly the sampled turns, <|im_end|> included, with the sampler's logprobs
        for span, text in zip(model_spans, sampled[q]):
            assert all(ep.model_mask[span.start : span.end])
            assert set(ep.sampler_logprobs[span.start : span.end]) == {-0.5}
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == text
        model_ids = [t for t, m in zip(ep.completion_ids, ep.model_mask) if m]
        assert tokenizer.decode(model_ids) == "".join(sampled[q])
        # mask 0: exactly the template's reply, each result in its own <tool_response>, in call order
        for span, results in zip(env_spans, RESULTS[q]):
            assert not any(ep.model_mask[span.start : span.end])
            assert set(ep.sampler_logprobs[span.start : span.end]) == {0.0}
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == reply(setup, results)
        # the canonical messages: the sampled text without <|im_end|>, the calls that parsed, one tool message a call
        assistant = [m for m in ep.messages if m["role"] == "assistant"]
        assert [m["content"] + "<|im_end|>" for m in assistant] == sampled[q]
        assert [[(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] for m in assistant] \
            == CALLS[q]
        assert all(c["type"] == "function" for m in assistant for c in m["tool_calls"])
        tool_messages = [(m["name"], m["content"]) for m in ep.messages if m["role"] == "tool"]
        assert tool_messages == [r for results in RESULTS[q] for r in results]


def test_tokenization_check_reports_what_the_protocol_docstring_says(rollout):
    """Qwen2.5 and Qwen3 with thinking on (turns in the template's layout) re-render token for token; Qwen3 with
    thinking off re-renders without the empty think block before each tool turn, so every episode with a tool
    turn is reported."""
    setup, tokenizer, env, questions, episodes, _ = rollout
    for q, ep in zip(questions, episodes):
        assert ep.tokenization_mismatch == (setup.thinking_off and ep.tool_turns > 0), q
        full = env.render_ids(env.prompt(q) + ep.messages)
        same = full[: len(ep.prompt_ids) + len(ep.completion_ids)] == ep.prompt_ids + ep.completion_ids
        assert same == (not ep.tokenization_mismatch)
        if setup.thinking_off and ep.tool_turns:  # exactly the pre-written blocks of the tool turns are missing
            rollout_text = tokenizer.decode(ep.prompt_ids + ep.completion_ids)
            rendered = tokenizer.decode(full)
            assert rollout_text.count(EMPTY_THINK) == rendered.count(EMPTY_THINK) + ep.tool_turns
    ratio = rollout_metrics(episode_stats(episodes))["rollout/tokenization_mismatch_ratio"]
    assert ratio == pytest.approx(4 / 5 if setup.thinking_off else 0.0)


def test_qwen3_thinking_turn_not_in_the_template_layout_is_reported(tokenizers):
    """Thinking on: a last turn without a thought re-renders with an empty think block it did not sample."""
    setup, tokenizer = SETUPS["qwen3-thinking"], tokenizers["qwen3"]
    env = setup_env(tokenizer, setup, [make_search([])])
    sampled = {**script(setup, {"Q-one": PLAN["Q-one"]}), "Q-plain": ["I am not sure.<|im_end|>"]}
    questions = list(sampled)
    one, plain = env.rollout([env.prompt(q) for q in questions], ScriptedPolicy(tokenizer, sampled))
    assert not one.tokenization_mismatch and plain.tokenization_mismatch
    assert rollout_metrics(episode_stats([one, plain]))["rollout/tokenization_mismatch_ratio"] == 0.5
    # the re-render differs by the empty think block before the turn
    rollout_text = tokenizer.decode(plain.prompt_ids + plain.completion_ids)
    rendered = tokenizer.decode(env.render_ids(env.prompt(questions[1]) + plain.messages))
    assert "<think>" not in rollout_text.split("Q-plain", 1)[1]
    assert rendered.split("Q-plain", 1)[1].count("<think>") == 1


def test_two_calls_in_a_turn_run_concurrently_and_come_back_in_order(tokenizers):
    *_, questions, episodes, log = roll_out(tokenizers, SETUPS["qwen2.5"], {"Q-two": PLAN["Q-two"]})
    (ep,) = episodes
    ran = {q: (start, end) for q, start, end in log}
    assert [q for q, *_ in log] == ["capital of Veltria", "Quorvath founded"]  # the second call finished first,
    assert ran["capital of Veltria"][0] < ran["Quorvath founded"][1]  # having started while the first still ran
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == [FACTS["Quorvath founded"],
                                                                         FACTS["capital of Veltria"]]
    assert [(c.turn, c.name, c.args, c.ok) for c in ep.calls] == [
        (0, "search", {"query": "Quorvath founded"}, True), (0, "search", {"query": "capital of Veltria"}, True)]
    assert [c.seconds >= ran[c.args["query"]][1] - ran[c.args["query"]][0] for c in ep.calls] == [True, True]


def test_malformed_calls_are_failed_calls_not_a_crash(tokenizers):
    *_, episodes, log = roll_out(tokenizers, SETUPS["qwen2.5"], {"Q-malformed": PLAN["Q-malformed"]})
    (ep,) = episodes
    assert ep.stop_reason == "answer"  # the episode went on after the errors
    assert [(c.name, c.ok) for c in ep.calls] == [("", False), ("lookup", False), ("search", True)]
    assert (ep.tool_turns, ep.tool_failures) == (1, 2)
    assert [q for q, *_ in log] == ["capital of Veltria"]  # only the good call ran
    assert [c["function"]["name"] for c in ep.messages[0]["tool_calls"]] == ["lookup", "search"]  # the parsed calls
    metrics = rollout_metrics(episode_stats([ep]))
    assert metrics["rollout/tool_calls_per_episode"] == 3
    assert metrics["rollout/tool_success_rate"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("limit, stop_reason", [("max_tokens_per_turn", "turn_length"),
                                                ("max_completion_length", "budget")])
def test_token_limits_end_the_episode_as_truncated(tokenizers, limit, stop_reason):
    """A turn cut at max_tokens_per_turn; a reply that does not fit what is left of the budget (no partial message)."""
    setup = SETUPS["qwen2.5"]
    first_turn = len(tokenizers["qwen2.5"].encode(script(setup)["Q-two"][0], add_special_tokens=False))
    overrides = ({"max_tokens_per_turn": 5} if limit == "max_tokens_per_turn"
                 else {"max_completion_length": first_turn + 10})
    _, _, _, (ep,), log = roll_out(tokenizers, setup, {"Q-two": PLAN["Q-two"]}, **overrides)
    assert ep.stop_reason == stop_reason and ep.truncated
    assert [s.role for s in ep.spans] == ["model"] and all(ep.model_mask) and not ep.calls
    assert bool(log) == (stop_reason == "budget")  # the calls ran; their reply did not fit
    assert len(ep.completion_ids) == (5 if limit == "max_tokens_per_turn" else first_turn)


# ------------------------------------------------------------------------------------------------
# rewards and the MT-GRPO split
# ------------------------------------------------------------------------------------------------
XML_CALL = '<tool>{"name": "search", "args": {"query": "capital of Veltria"}}</tool>'
EQUIVALENT = {  # one episode in each format: search, then answer
    "xml": ["<reasoning>I look it up.</reasoning>\n" + XML_CALL,
            "<reasoning>Found it.</reasoning>\n<answer>Morvane</answer>"],
    "chat_template": ["I look it up.\n" + ONE + "<|im_end|>", "Found it.\n<answer>Morvane</answer><|im_end|>"],
}


def test_rewards_see_the_same_messages_in_both_formats(qwen_style_tokenizer, tokenizers):
    from mt_grpo.rewards import REWARD_FUNCS, count_tool_turns

    log = []
    episodes = {}
    for fmt, tokenizer in (("xml", qwen_style_tokenizer), ("chat_template", tokenizers["qwen2.5"])):
        protocol = XMLProtocol() if fmt == "xml" else ChatTemplateProtocol(tokenizer)
        env = make_env(tokenizer, [make_search(log)], protocol, max_tokens_per_turn=100)
        policy = ScriptedPolicy(tokenizer, {"Q-capital": EQUIVALENT[fmt]})
        (episodes[fmt],) = env.rollout([env.prompt("Q-capital")], policy)
        assert episodes[fmt].stop_reason == "answer" and not episodes[fmt].tokenization_mismatch
    xml, chat = episodes["xml"].messages, episodes["chat_template"].messages
    assert [m["role"] for m in xml] == [m["role"] for m in chat] == ["assistant", "tool", "assistant"]
    assert [m for m in xml if m["role"] == "tool"] == [m for m in chat if m["role"] == "tool"]
    assert [m["tool_calls"] for m in xml if m["role"] == "assistant"] == \
        [m["tool_calls"] for m in chat if m["role"] == "assistant"]
    assert count_tool_turns(xml) == count_tool_turns(chat) == 1
    score = lambda name, completion: REWARD_FUNCS[name]([None], [completion], answer_aliases=[["Morvane"]])[0]  # noqa: E731
    for name in ("tool_execution_reward_func", "exist_answer_in_search_results", "exact_match_reward_func",
                 "exist_answer_reward_func"):
        assert score(name, xml) == score(name, chat), name
    assert score("format_reward_func", xml) == score("chat_format_reward_func", chat) == pytest.approx(0.2)


# (tool_execution, exist_answer_in_search_results, exact_match, exist_answer, chat_format), answers ["Morvane"]
EXPECTED_REWARDS = {
    "Q-one": (0.2, 0.5, 1.0, 0.5, 0.2),
    "Q-two": (0.2, 0.5, 0.0, 0.5, 0.2),  # "1740, Morvane" contains the alias but is not it
    "Q-malformed": (0.2 / 3, 0.5, 1.0, 0.5, 0.2 * (2 / 3 + 1) / 2),  # 1 of 3 calls ran; 2 of 3 parsed, then an answer
    "Q-silent": (0.0, 0.0, 0.0, 0.0, 0.0),
    "Q-again": (0.2, 0.5, 0.0, 0.0, 0.2),  # no answer; the third turn's call parsed (not run)
}


def test_shipped_rewards_on_chat_template_episodes(rollout):
    from mt_grpo.rewards import REWARD_FUNCS, count_tool_turns

    setup, tokenizer, env, questions, episodes, _ = rollout
    completions = [ep.messages for ep in episodes]
    names = ("tool_execution_reward_func", "exist_answer_in_search_results", "exact_match_reward_func",
             "exist_answer_reward_func", "chat_format_reward_func")
    values = [REWARD_FUNCS[n]([None] * len(episodes), completions, answer_aliases=[["Morvane"]] * len(episodes)) for n in names]
    for i, q in enumerate(questions):
        assert tuple(v[i] for v in values) == pytest.approx(EXPECTED_REWARDS[q]), q
        assert count_tool_turns(completions[i]) == episodes[i].tool_turns  # rewards and trainer count the same turns
    per_turn = REWARD_FUNCS["tool_execution_per_turn"]([None] * len(episodes), completions)
    expected = {"Q-one": [0.2], "Q-two": [0.2], "Q-malformed": [0.2 / 3], "Q-silent": [], "Q-again": [0.2, 0.2]}
    for q, values in zip(questions, per_turn):
        assert values == pytest.approx(expected[q]), q


def test_mt_grpo_split_is_at_the_first_tool_result(tokenizers):
    """Two calls in the first turn: turn 0 is that whole turn, up to its one reply; the answer is turn 1."""
    plan = {"Q-two": PLAN["Q-two"], "Q-one": PLAN["Q-one"]}
    _, _, _, (two, one), _ = roll_out(tokenizers, SETUPS["qwen3-thinking"], plan)
    first_turn, reply_span, answer_turn = two.spans
    assert result_start(two.spans, len(two.completion_ids)) == reply_span.start == first_turn.end
    turns = token_turn_index(two.spans, len(two.completion_ids))
    assert turns.tolist() == [0] * first_turn.end + [-1] * (reply_span.end - reply_span.start) + \
        [1] * (answer_turn.end - answer_turn.start)
    batch = pad_episodes([two, one], pad_id=0, mask_truncated=False)
    T = batch["completion_ids"].shape[1]
    assert batch["token_turns"][0].tolist() == turns.tolist() + [-1] * (T - len(two.completion_ids))
    # R_T favours Q-two, R_O favours Q-one: Q-two's first turn gets A_O + A_T = 0, its answer A_O < 0
    adv = mt_grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), batch["token_turns"], AdvantageSettings.of("mt_grpo", 2, turn_advantage_coef=1.0))
    tokens = adv.tokens[0]
    assert tokens[: first_turn.end].abs().max() < 1e-6
    assert torch.allclose(tokens[answer_turn.start : answer_turn.end], adv.outcome[0])
    assert adv.outcome[0] < 0
    # per_turn credit with the episode's one tool turn: the same tokens get the same advantages
    per_turn = mt_grpo_advantages(torch.tensor([[1.0], [0.0]]), torch.tensor([0.0, 1.0]), batch["token_turns"], AdvantageSettings.of("per_turn", 2, turn_advantage_coef=1.0))
    model_tokens = batch["tool_mask"][0].bool()
    assert torch.allclose(per_turn.tokens[0][model_tokens], tokens[model_tokens])


# ------------------------------------------------------------------------------------------------
# training on CPU, and the 7B recipe's launch command
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_template_agent_dir(tiny_agent_dir, tmp_path_factory):
    return make_chat_template_agent(tiny_agent_dir, str(tmp_path_factory.mktemp("tiny-agent-chat-template")))


def test_two_steps_train_with_chat_template_tool_calls(chat_template_agent_dir, tmp_path):
    out = str(tmp_path / "out")
    run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path", chat_template_agent_dir,
         "--output_dir", out, "--save_strategy", "no", "--save_rollouts_steps", "1", *CHAT_TEMPLATE_FLAGS], tmp_path)
    # the prompts carry the tools as the template renders them (the xml protocol lists them in its system prompt)
    assert all("<tools>" in r["prompt_text"] for r in rollout_records(out))
    steps = [h for h in final_metrics(out) if "loss" in h]
    assert len(steps) == 2
    for key in ["rewards/turn/mean", "rewards/outcome/mean", "rewards/turn/tool_execution_reward_func",
                "rewards/outcome/chat_format_reward_func", "rollout/tool_calls_per_episode",
                "rollout/tool_success_rate", "rollout/tokenization_mismatch_ratio", "rollout/stop/answer",
                "rollout/env_tokens", "clip_ratio/region_mean"]:
        assert all(key in h for h in steps), key
    # the taught model calls tools through the template, and the environment answers them
    assert any(h["rollout/tool_calls_per_episode"] > 0 and h["rollout/env_tokens"] > 0 for h in steps), steps
    assert changed_parameters(chat_template_agent_dir, out), "no parameter changed after 2 optimizer steps"


@pytest.mark.parametrize("recipe, chat_template_kwargs", [
    ("hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml", None),
    ("hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo_lora.yaml", None),
    ("hf_recipes/Qwen/Qwen3-8B/mt_grpo.yaml", {"enable_thinking": False}),
    ("hf_recipes/Qwen/Qwen3-8B/mt_grpo_lora.yaml", {"enable_thinking": False}),
    ("hf_recipes/Qwen/Qwen3-8B/mt_grpo_thinking.yaml", {"enable_thinking": True}),
    ("hf_recipes/Qwen/Qwen2.5-7B-Instruct/textworld_quest.yaml", None),
])
def test_launch_dry_run_trains_the_recipe_with_chat_template(recipe, chat_template_kwargs):
    """The training command carries the recipe, and the trainer's parser reads its tool format from it. (Only
    the script arguments are built: GRPOConfig checks the batch against the 7 training processes of the node.)"""
    import yaml
    from trl import TrlParser

    from mt_grpo_trainer import MTGRPOScriptArguments

    out = subprocess.run(["bash", "launch.sh", "--dry-run", recipe], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    train = shlex.split(out.stdout.strip().splitlines()[-1])
    argv = train[train.index("mt_grpo_trainer.py") + 1:]
    assert argv[:2] == ["--config", recipe] and "--tool_format" not in argv  # the recipe's setting, not overridden
    script_args, _ = TrlParser((MTGRPOScriptArguments,)).parse_args_and_config(argv, return_remaining_strings=True)
    assert script_args.tool_format == "chat_template"
    assert "chat_format_reward_func" in script_args.outcome_reward_funcs
    with open(os.path.join(ROOT, recipe)) as f:
        assert yaml.safe_load(f).get("chat_template_kwargs") == chat_template_kwargs
