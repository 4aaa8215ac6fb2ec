"""The chat_template protocol end to end (issue 13): scripted episodes through Qwen2.5's and Qwen3's real chat
templates with exact masks, the tokenization check, the rewards on the canonical messages, the MT-GRPO split,
a 2-step training run on CPU, and the 7B recipe's launch command. Parsing, tool schemas and the rules of a
Qwen3 re-render are in test_protocol.py; the run against a live vLLM server is in test_vllm_server.py.

The tokenizers are the tiny one with a Qwen template and the tokens the real Qwen tokenizers add as
non-special added tokens, so that `<tool_call>` or `</think>` is one id, never merged with its neighbours,
and is kept by `decode(skip_special_tokens=True)`, as with the real ones. Every scripted turn ends with
`<|im_end|>`, as a Qwen model ends its turns (the chat_template protocol has no stop string).
"""

import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from helpers import RECIPE, ROOT, changed_parameters, final_metrics, run
from mt_grpo_trainer import MultiTurnToolEnv, mt_grpo_advantages, pad_episodes, result_start, token_turn_index
from protocol import ChatTemplateProtocol, XMLProtocol
from reporting import episode_stats, rollout_metrics
from scripted_policy import ScriptedPolicy

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
TEMPLATE_FILES = {"qwen2.5": os.path.join(FIXTURES, "qwen2.5_chat_template.jinja"),
                  "qwen3": os.path.join(FIXTURES, "qwen3_chat_template.jinja")}
# The non-special added tokens of the real tokenizers (Qwen2.5-7B-Instruct: ids 151657-151658; Qwen3-8B:
# 151657-151658 and 151665-151668).
ADDED_TOKENS = {"qwen2.5": ["<tool_call>", "</tool_call>"],
                "qwen3": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]}
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3 pre-writes before every turn with enable_thinking=False
CT = ChatTemplateProtocol()


def qwen_tokenizer(model_dir: str, template: str):
    """The tiny tokenizer of `model_dir` with a Qwen template and that Qwen's added tokens."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS[template]])
    with open(TEMPLATE_FILES[template]) as f:
        tokenizer.chat_template = f.read()
    return tokenizer


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
FACTS = {"capital of Veltria": "Veltria: Veltria is a country. Its capital is Morvane.",
         "Quorvath founded": "Quorvath: Quorvath is a city founded in 1740."}
SLOW = {"Quorvath founded": 0.5}  # seconds; this call comes first in its turn and finishes last


def make_search(log: list):
    """A search tool that appends (query, start, end) to `log` for every call it runs."""

    def search(query: str) -> str:
        """Search the knowledge base.

        Args:
            query: words to look up, e.g. "capital of Veltria".
        """
        start = time.monotonic()
        time.sleep(SLOW.get(query, 0.0))
        log.append((query, start, time.monotonic()))
        return FACTS.get(query, f"No documents match the query {query!r}.")

    return search


def call(query: str, name: str = "search") -> str:
    return CT.format_call(name, {"query": query})


ONE = call("capital of Veltria")
TWO = call("Quorvath founded") + "\n" + call("capital of Veltria")
BAD_JSON = '<tool_call>\n{"name": "search", "arguments": {"query": }}\n</tool_call>'
# question -> (thought, visible text) of each model turn
PLAN = {
    "Q-one": [("I look it up.", "Let me search.\n" + ONE), ("Found it.", "<answer>Morvane</answer>")],
    "Q-two": [("I need two facts.", "I look up both.\n" + TWO),
              ("Both found.", "Founded in 1740; the capital is Morvane.\n<answer>1740, Morvane</answer>")],
    "Q-malformed": [("I try three calls.", BAD_JSON + "\n" + call("Quorvath founded", name="lookup") + "\n" + ONE),
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
    "Q-malformed": [[("", "Error: the tool call is not valid JSON (Expecting value at char 43)."),
                     ("lookup", "Error: unknown tool 'lookup'; available tools: ['search']"),
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


def make_env(tokenizer, setup: Setup, tools: list, **overrides):
    kwargs = dict(max_env_steps=2, max_tokens_per_turn=200, max_completion_length=800, max_tool_response_tokens=64,
                  tokenization_check="strict", few_shot=True, chat_template_kwargs=setup.chat_template_kwargs)
    kwargs.update(overrides)
    return MultiTurnToolEnv(tokenizer=tokenizer, protocol=ChatTemplateProtocol(tokenizer), tools=tools, **kwargs)


def roll_out(tokenizers, setup: Setup, plan: dict = PLAN, **overrides):
    """(tokenizer, env, questions, episodes, tool call log) of one batch with every question of `plan`."""
    tokenizer, log = tokenizers[setup.template], []
    env = make_env(tokenizer, setup, [make_search(log)], **overrides)
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
            assert all(ep.env_mask[span.start : span.end])
            assert set(ep.sampler_logprobs[span.start : span.end]) == {-0.5}
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == text
        model_ids = [t for t, m in zip(ep.completion_ids, ep.env_mask) if m]
        assert tokenizer.decode(model_ids) == "".join(sampled[q])
        # mask 0: exactly the template's reply, each result in its own <tool_response>, in call order
        for span, results in zip(env_spans, RESULTS[q]):
            assert not any(ep.env_mask[span.start : span.end])
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


def test_qwen3_thinking_turn_not_in_the_template_layout_is_reported(tokenizers, caplog):
    """Thinking on: a last turn without a thought re-renders with an empty think block it did not sample."""
    setup, tokenizer = SETUPS["qwen3-thinking"], tokenizers["qwen3"]
    env = make_env(tokenizer, setup, [make_search([])])
    sampled = {**script(setup, {"Q-one": PLAN["Q-one"]}), "Q-plain": ["I am not sure.<|im_end|>"]}
    with caplog.at_level(logging.WARNING, logger="mt_grpo"):
        one, plain = env.rollout([env.prompt(q) for q in sampled], ScriptedPolicy(tokenizer, sampled))
    assert not one.tokenization_mismatch and plain.tokenization_mismatch
    assert "Tokenization check (strict): 1 of 2 rollouts differ" in caplog.text
    assert "<think>" in caplog.text.split("a re-render", 1)[1]


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
    assert ep.calls[0].seconds >= SLOW["Quorvath founded"] > ep.calls[1].seconds


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
    assert [s.role for s in ep.spans] == ["model"] and all(ep.env_mask) and not ep.calls
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
    from rewards import REWARD_FUNCS, count_tool_turns

    log = []
    episodes = {}
    for fmt, tokenizer in (("xml", qwen_style_tokenizer), ("chat_template", tokenizers["qwen2.5"])):
        protocol = XMLProtocol() if fmt == "xml" else ChatTemplateProtocol(tokenizer)
        env = MultiTurnToolEnv(tokenizer=tokenizer, protocol=protocol, tools=[make_search(log)], max_env_steps=2,
                               max_tokens_per_turn=100, max_completion_length=400, max_tool_response_tokens=64,
                               tokenization_check="strict")
        policy = ScriptedPolicy(tokenizer, {"Q-capital": EQUIVALENT[fmt]})
        (episodes[fmt],) = env.rollout([env.prompt("Q-capital")], policy)
        assert episodes[fmt].stop_reason == "answer" and not episodes[fmt].tokenization_mismatch
    xml, chat = episodes["xml"].messages, episodes["chat_template"].messages
    assert [m["role"] for m in xml] == [m["role"] for m in chat] == ["assistant", "tool", "assistant"]
    assert [m for m in xml if m["role"] == "tool"] == [m for m in chat if m["role"] == "tool"]
    assert [m["tool_calls"] for m in xml if m["role"] == "assistant"] == \
        [m["tool_calls"] for m in chat if m["role"] == "assistant"]
    assert count_tool_turns(xml) == count_tool_turns(chat) == 1
    score = lambda name, completion: REWARD_FUNCS[name]([None], [completion], answer=[["Morvane"]])[0]  # noqa: E731
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
    from rewards import REWARD_FUNCS, count_tool_turns

    setup, tokenizer, env, questions, episodes, _ = rollout
    completions = [ep.messages for ep in episodes]
    names = ("tool_execution_reward_func", "exist_answer_in_search_results", "exact_match_reward_func",
             "exist_answer_reward_func", "chat_format_reward_func")
    values = [REWARD_FUNCS[n]([None] * len(episodes), completions, answer=[["Morvane"]] * len(episodes)) for n in names]
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
    adv = mt_grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), batch["token_turns"], group_size=2,
                             mode="mt_grpo", turn_advantage_coef=1.0)
    tokens = adv.tokens[0]
    assert tokens[: first_turn.end].abs().max() < 1e-6
    assert torch.allclose(tokens[answer_turn.start : answer_turn.end], adv.outcome[0])
    assert adv.outcome[0] < 0
    # per_turn credit with the episode's one tool turn: the same tokens get the same advantages
    per_turn = mt_grpo_advantages(torch.tensor([[1.0], [0.0]]), torch.tensor([0.0, 1.0]), batch["token_turns"],
                                  group_size=2, mode="per_turn", turn_advantage_coef=1.0)
    model_tokens = batch["tool_mask"][0].bool()
    assert torch.allclose(per_turn.tokens[0][model_tokens], tokens[model_tokens])


# ------------------------------------------------------------------------------------------------
# training on CPU, and the 7B recipe's launch command
# ------------------------------------------------------------------------------------------------
CHAT_AGENT_TURNS = [ONE + "<|im_end|>", "<answer>Morvane</answer><|im_end|>"]


def make_chat_template_agent(src_dir: str, out_dir: str, steps: int = 100) -> str:
    """A copy of the tiny agent model (`src_dir`) whose tokenizer is Qwen2.5-style: the Qwen2.5 template fixture
    and the <tool_call> tokens (embeddings resized), taught for a few seconds to answer a question, or a tool
    response, with one of CHAT_AGENT_TURNS: a hermes call to `search` or an <answer>, then <|im_end|>. It learns
    the tags and the end of turn, rarely the JSON: its episodes mix answers, malformed calls answered with an
    error, and long turns cut at the token limit. It learns from the last 48 tokens of the prompts the trainer
    renders (with the repo's `search` tool): the question and what follows it, which is what it must react to,
    at a fraction of the cost of the whole prompt."""
    from transformers import AutoModelForCausalLM

    from tools.search import make_search_tool

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    tokenizer = qwen_tokenizer(src_dir, "qwen2.5")
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    tools = CT.template_tools([make_search_tool([{"title": "Veltria", "text": FACTS["capital of Veltria"]}])])
    prompts, turns = [], []
    for question in ["What is the capital of Veltria?", "In which year was Quorvath founded?"]:
        for history in ([], [{"role": "assistant", "content": CHAT_AGENT_TURNS[0][: -len("<|im_end|>")]},
                             {"role": "tool", "name": "search", "content": FACTS["capital of Veltria"]}]):
            messages = [{"role": "system", "content": CT.system_prompt([])}, {"role": "user", "content": question},
                        *history]
            prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            for text in CHAT_AGENT_TURNS:
                prompts.append(tokenizer.encode(prompt)[-48:])  # the question and what follows it
                turns.append(tokenizer.encode(text))
    # one padded batch (B, T) per step; the loss is on the turn's tokens only
    T = max(len(p) + len(t) for p, t in zip(prompts, turns))
    ids = torch.tensor([p + t + [tokenizer.pad_token_id] * (T - len(p) - len(t)) for p, t in zip(prompts, turns)])
    labels = torch.tensor([[-100] * len(p) + t + [-100] * (T - len(p) - len(t)) for p, t in zip(prompts, turns)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small: 4 s on one thread, minutes on two when another process holds a core
    try:
        for _ in range(steps):
            model(input_ids=ids, labels=labels).loss.backward()  # right padding: causal attention never sees it
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


CHAT_TEMPLATE_FLAGS = ["--tool_format", "chat_template", "--outcome_reward_funcs", "exact_match_reward_func",
                       "exist_answer_reward_func", "chat_format_reward_func"]


@pytest.fixture(scope="module")
def chat_template_agent_dir(tiny_agent_dir, tmp_path_factory):
    return make_chat_template_agent(tiny_agent_dir, str(tmp_path_factory.mktemp("tiny-agent-chat-template")))


def test_two_steps_train_with_chat_template_tool_calls(chat_template_agent_dir, tmp_path):
    out = str(tmp_path / "out")
    log = run([sys.executable, "mt_grpo_trainer.py", "--config", RECIPE, "--model_name_or_path",
               chat_template_agent_dir, "--output_dir", out, "--save_strategy", "no", *CHAT_TEMPLATE_FLAGS], tmp_path)
    assert "tool format: chat_template" in log and "step    2 |" in log
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
    ("hf_recipes/Qwen/Qwen3-8B/mt_grpo.yaml", {"enable_thinking": False}),
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
