"""MultiTurnToolEnv on real chat templates, driven by a scripted policy: masks, spans, stopping,
budgets, and the tool-call parser."""

import copy
import threading

import pytest

from helpers import fake_search, make_env
from mt_grpo.rollout.episodes import pad_episodes
from mt_grpo.rollout.tool_calls import ToolResult, run_tool_calls
from mt_grpo.base.protocol import ToolCall, XMLProtocol
from scripted_policy import ScriptedPolicy

TOOL = '<tool>{"name": "search", "args": {"query": "capital of Veltria"}}</tool>'
SCRIPT = {
    "Q-search": ["<reasoning>I should look it up.</reasoning>\n" + TOOL, "<reasoning>Found it.</reasoning>\n<answer>Morvane</answer>"],
    "Q-direct": ["<reasoning>I know this.</reasoning>\n<answer>Morvane</answer>"],
    "Q-broken": ['<tool>{"name": "search", "args": {"query": "x"</tool>', '<tool>{"name": "nope", "args": {}}</tool>',
                 TOOL],  # bad JSON, unknown tool, then a call past max_env_steps=2: not run
    "Q-silent": ["I am not sure."],
}


search = fake_search(lambda query: f"Veltria is a country. Its capital is Morvane. (query: {query})")


@pytest.fixture(params=["smollm2", "qwen2.5"])
def tokenizer(request, smollm2_tokenizer, qwen_style_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else qwen_style_tokenizer


def test_masks_spans_and_texts_on_real_templates(tokenizer):
    env = make_env(tokenizer, [search])
    questions = list(SCRIPT)
    episodes = env.rollout([env.prompt(q) for q in questions], ScriptedPolicy(tokenizer, SCRIPT))
    expected_stop = {"Q-search": "answer", "Q-direct": "answer", "Q-broken": "max_env_steps", "Q-silent": "no_action"}
    for q, ep in zip(questions, episodes):
        assert ep.stop_reason == expected_stop[q]
        assert len(ep.completion_ids) == len(ep.model_mask) == len(ep.sampler_logprobs)
        # spans tile the completion and alternate model / env, starting with the model
        assert ep.spans[0].start == 0 and ep.spans[-1].end == len(ep.completion_ids)
        assert all(a.end == b.start and a.role != b.role for a, b in zip(ep.spans, ep.spans[1:]))
        model_turns = [s for s in ep.spans if s.role == "model"]
        # decoding only mask-1 tokens gives exactly the sampled texts, turn by turn and in all
        for span, text in zip(model_turns, SCRIPT[q]):
            assert all(ep.model_mask[span.start : span.end])
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == text
        model_ids = [t for t, m in zip(ep.completion_ids, ep.model_mask) if m]
        assert tokenizer.decode(model_ids) == "".join(SCRIPT[q][: len(model_turns)])
        # decoding mask-0 tokens gives exactly the tool output as a <result> user turn in the template's markers
        env_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
        env_spans = [s for s in ep.spans if s.role == "env"]
        assert len(env_spans) == len(env_msgs) == ep.tool_turns
        for span, content in zip(env_spans, env_msgs):
            assert not any(ep.model_mask[span.start : span.end])
            assert set(ep.sampler_logprobs[span.start : span.end]) == {0.0}
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == (
                f"<|im_end|>\n<|im_start|>user\n<result>\n{content}\n</result><|im_end|>\n<|im_start|>assistant\n")
        # the whole thing equals a fresh render of the conversation, token for token
        assert not ep.tokenization_mismatch
        full = env.render_ids(env.prompt(q) + ep.messages)
        assert full[: len(ep.prompt_ids) + len(ep.completion_ids)] == ep.prompt_ids + ep.completion_ids


def test_tool_results_and_errors_reach_the_model(tokenizer):
    env = make_env(tokenizer, [search])
    search_ep, _, broken_ep, _ = env.rollout([env.prompt(q) for q in SCRIPT], ScriptedPolicy(tokenizer, SCRIPT))
    assert search_ep.messages[1] == {"role": "tool", "name": "search",
                                     "content": search(query="capital of Veltria")}
    assert search_ep.messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "search", "arguments": {"query": "capital of Veltria"}}}]
    assert (search_ep.tool_turns, search_ep.tool_failures) == (1, 0)
    errors = [m for m in broken_ep.messages if m["role"] == "tool"]
    assert "not valid JSON" in errors[0]["content"] and errors[0]["name"] == ""
    assert "unknown tool 'nope'" in errors[1]["content"] and errors[1]["name"] == "nope"
    assert all(e["content"].startswith("Error: ") for e in errors)
    assert broken_ep.messages[0]["tool_calls"] == []  # the malformed call did not parse
    # max_env_steps=2: the third call was sampled but not run, and nothing follows it
    assert (broken_ep.tool_turns, broken_ep.tool_failures, len(broken_ep.calls)) == (2, 2, 2)
    assert [c.turn for c in broken_ep.calls] == [0, 1] and not any(c.ok for c in broken_ep.calls)
    assert broken_ep.spans[-1].role == "model" and broken_ep.messages[-1]["content"] == TOOL


def test_live_conversations_advance_together_one_call_per_step(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer, [search])
    policy = ScriptedPolicy(smollm2_tokenizer, SCRIPT)
    # a group of 4 identical prompts, as GRPO sends them: the first step asks for n=4 of one prompt
    env.rollout([env.prompt("Q-search")] * 4, policy)
    assert policy.calls == [(1, 4), (4, 1)]
    policy.calls.clear()
    env.rollout([env.prompt(q) for q in SCRIPT], policy)
    assert policy.calls == [(4, 1), (2, 1), (1, 1)]  # search + broken after round 1, broken after round 2


def test_turn_token_limit_truncates_the_episode(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer, [search], max_tokens_per_turn=5)
    (ep,) = env.rollout([env.prompt("Q-direct")], ScriptedPolicy(smollm2_tokenizer, SCRIPT))
    assert ep.stop_reason == "turn_length" and ep.truncated and len(ep.completion_ids) == 5


def test_env_reply_that_does_not_fit_the_budget_ends_the_episode_without_a_partial_message(smollm2_tokenizer):
    first_turn = len(smollm2_tokenizer.encode(SCRIPT["Q-search"][0], add_special_tokens=False))
    env = make_env(smollm2_tokenizer, [search], max_completion_length=first_turn + 10)
    (ep,) = env.rollout([env.prompt("Q-search")], ScriptedPolicy(smollm2_tokenizer, SCRIPT))
    assert ep.stop_reason == "budget" and ep.truncated
    assert [s.role for s in ep.spans] == ["model"] and all(ep.model_mask)


def test_long_tool_output_is_cut_with_a_marker(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer, [search], max_tool_response_tokens=8)
    text = env.truncate_tool_output(" ".join(["word"] * 100))  # 100 tokens
    assert text.endswith("[truncated: 8 of 100 tokens shown]")
    assert env.truncate_tool_output("short") == "short"


@pytest.mark.parametrize(
    "text, answer, call",
    [
        ('<reasoning>r</reasoning><tool>{"name": "search", "args": {"query": "q"}}</tool>', None,
         ToolCall("search", {"query": "q"})),
        ("<reasoning>r</reasoning><answer> Morvane </answer>", "Morvane", None),
        ('<tool>{"name": "search", "args": {"query": "q"}</tool>', None, ToolCall("", error="not valid JSON")),
        ('<tool>["search"]</tool>', None, ToolCall("", error="JSON object")),
        ('<tool>{"name": "search", "args": "q"}</tool>', None, ToolCall("search", error='"args" must be')),
        ("<answer>x</tool>", None, ToolCall("", error="opened but not closed")),  # the stop string did not match the tag
        ('<tool>{"name": "search"', None, ToolCall("", error="opened but not closed")),
        ("<answer>never closed", None, ToolCall("", error="opened but not closed")),
    ],
)
def test_xml_parse(text, answer, call):
    turn = XMLProtocol().parse(text)
    assert turn.answer == answer
    if call is None:
        assert turn.calls == [] and turn.kind == "answer"
        return
    (parsed,) = turn.calls
    assert (parsed.name, parsed.arguments) == (call.name, call.arguments)
    assert call.error in parsed.error and bool(parsed.error) == bool(call.error)
    assert not any(tag in parsed.error for tag in XMLProtocol.TAGS)  # the model copies error text


@pytest.mark.parametrize("text", ["just prose", ""])
def test_xml_parse_of_a_turn_without_action(text):
    turn = XMLProtocol().parse(text)
    assert (turn.kind, turn.answer, turn.calls) == ("none", None, [])


def test_tool_calls_run_concurrently_and_a_stuck_tool_costs_only_its_timeout():
    """Events, not sleeps, so that nothing depends on the machine's speed: four calls that can only return
    together (a barrier of four) return, so they ran at once; a call stuck until the test lets it go times out,
    and run_tool_calls returns while it is still stuck (it waited for the timeout, not for the call)."""
    together, release, finished = threading.Barrier(4), threading.Event(), []

    def meet() -> str:
        together.wait(timeout=60)  # BrokenBarrierError, a failed call, had the four not run at once
        return "done"

    def stuck() -> str:
        release.wait()
        finished.append("stuck")
        return "late"

    def broken() -> str:
        raise KeyError("boom")

    tools = {"meet": meet, "stuck": stuck, "broken": broken}
    calls = [ToolCall("meet") for _ in range(4)] + [ToolCall("broken"), ToolCall("meet", {"secs": 1}),
                                                    ToolCall("", error="the tool call is not valid JSON.")]
    results = run_tool_calls(tools, calls, timeout=120, max_workers=8)
    assert [(r.output, r.ok) for r in results[:4]] == [("done", True)] * 4
    assert results[4].output.startswith("Error: tool 'broken' raised KeyError") and not results[4].ok
    assert results[5].output.startswith("Error: bad arguments for tool 'meet'")
    assert results[6] == ToolResult("Error: the tool call is not valid JSON.", False)  # malformed: never run
    try:
        (result,) = run_tool_calls(tools, [ToolCall("stuck")], timeout=0.5, max_workers=8)
        assert finished == []  # returned while the call is still stuck
    finally:
        release.set()
    assert result == ToolResult("Error: tool 'stuck' timed out after 0.5s", False, 0.5)


def test_a_type_error_inside_a_tool_is_the_tools_not_the_models_bad_arguments():
    """The arguments are checked against the signature before the call: a model's wrong argument names are bad
    arguments (the tool never runs), while a TypeError the tool's own code raises on well-named arguments (a number
    given as text, "3" * 1.5) is reported as the tool's error, which is what the model has to fix."""
    ran = []

    def scale(value: float, factor: float) -> str:
        """Multiply a number by a factor.

        Args:
            value: The number.
            factor: The factor.
        """
        ran.append(value)
        return str(value * factor)

    calls = [ToolCall("scale", {"value": "3", "factor": 1.5}), ToolCall("scale", {"amount": 3, "factor": 1.5}),
             ToolCall("scale", {"value": 2, "factor": 1.5})]
    results = run_tool_calls({"scale": scale}, calls, timeout=60, max_workers=4)
    assert [r.output for r in results] == [
        "Error: tool 'scale' raised TypeError: can't multiply sequence by non-int of type 'float'",
        "Error: bad arguments for tool 'scale': missing a required argument: 'value'", "3.0"]
    assert [r.ok for r in results] == [False, False, True] and sorted(ran, key=str) == [2, "3"]


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_padding_and_the_truncated_episode_setting(smollm2_tokenizer, mask_truncated):
    env = make_env(smollm2_tokenizer, [search], max_tokens_per_turn=5)
    policy = ScriptedPolicy(smollm2_tokenizer, SCRIPT)
    truncated, done = env.rollout([env.prompt("Q-search"), env.prompt("Q-silent")], policy)
    assert truncated.truncated and not done.truncated
    batch = pad_episodes([truncated, done], smollm2_tokenizer.pad_token_id, mask_truncated)
    T = max(len(truncated.completion_ids), len(done.completion_ids))
    assert batch["completion_ids"].shape == batch["tool_mask"].shape == batch["sampler_logps"].shape == (2, T)
    assert batch["tool_mask"][1].tolist() == done.model_mask + [0] * (T - len(done.model_mask))
    assert batch["tool_mask"][0].sum().item() == (0 if mask_truncated else 5)
    assert batch["prompt_mask"][:, -1].tolist() == [1, 1]  # prompts are left-padded


def test_each_turn_asks_for_at_most_what_is_left_of_the_budget(smollm2_tokenizer):
    first = len(smollm2_tokenizer.encode(SCRIPT["Q-search"][0], add_special_tokens=False))
    env = make_env(smollm2_tokenizer, [search], max_tokens_per_turn=64, max_completion_length=first + 60)
    seen = []

    class Recording(ScriptedPolicy):
        def generate(self, prompts, max_tokens, n=1, params=None):
            seen.append(list(max_tokens))
            return super().generate(prompts, max_tokens, n, params)

    (ep,) = env.rollout([env.prompt("Q-search")], Recording(smollm2_tokenizer, SCRIPT))
    env_tokens = ep.spans[1].end - ep.spans[1].start
    assert seen == [[min(64, first + 60)], [first + 60 - first - env_tokens]]


def test_model_text_is_never_evaluated():
    """Tools get parsed JSON arguments only; nothing in the trainer evaluates text."""
    hostile = '<tool>{"name": "__import__(\'os\').system(\'touch /tmp/pwned\')", "args": {"query": "__import__"}}</tool>'
    (call,) = XMLProtocol().parse(hostile).calls
    assert call.arguments == {"query": "__import__"}
    (result,) = run_tool_calls({"search": search}, [call], timeout=1.0, max_workers=1)
    assert not result.ok and result.output.startswith("Error: unknown tool")
    import ast
    import inspect
    import mt_grpo_trainer

    calls = {n.func.id for n in ast.walk(ast.parse(inspect.getsource(mt_grpo_trainer)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"eval", "exec", "compile"}


class OneSample(ScriptedPolicy):
    """A backend that answers every conversation with the same sample."""

    external = False

    def __init__(self, sample):
        super().__init__(None, {})
        self.sample = sample

    def generate(self, prompts, max_tokens, n=1, params=None):
        return [self.sample] * (len(prompts) * n)


def test_a_sample_vllm_cut_for_repetition_ends_the_episode_as_truncated(smollm2_tokenizer):
    from mt_grpo.base.completions import Sample
    from mt_grpo.run.reporting import episode_stats, rollout_metrics

    env = make_env(smollm2_tokenizer, [search])
    ids = smollm2_tokenizer.encode("<reasoning>again again again", add_special_tokens=False)
    (ep,) = env.rollout([env.prompt("Q-direct")], OneSample(Sample(ids, [-0.1] * len(ids), "repetition")))
    assert ep.stop_reason == "repetition" and ep.truncated
    metrics = rollout_metrics(episode_stats([ep]))
    assert metrics["rollout/stop/repetition"] == 1.0 and metrics["rollout/truncated_ratio"] == 1.0


@pytest.mark.parametrize("end_of_turn, expected_close", [
    ("<|im_end|>", ""),  # the model closed its turn with the template's own close: not repeated
    ("<|endoftext|>", "<|im_end|>"),  # another end-of-turn id: the template's close follows it
])
def test_end_of_turn_ids_of_the_generation_config_are_not_doubled(qwen_style_tokenizer, end_of_turn, expected_close):
    """Qwen2.5's base tokenizer has eos <|endoftext|> while its chat turns end with <|im_end|>; both are
    end-of-turn ids (generation_config.eos_token_id lists both)."""
    tokenizer = copy.deepcopy(qwen_style_tokenizer)  # a session fixture: change a copy
    tokenizer.eos_token = "<|endoftext|>"
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    env = make_env(tokenizer, [search], eos_token_ids=eos_ids)
    script = {"Q-search": [SCRIPT["Q-search"][0] + end_of_turn, SCRIPT["Q-search"][1]]}
    (ep,) = env.rollout([env.prompt("Q-search")], ScriptedPolicy(tokenizer, script))
    model_turn, reply = ep.spans[0], ep.spans[1]
    assert tokenizer.decode(ep.completion_ids[model_turn.start : model_turn.end]).endswith("</tool>" + end_of_turn)
    assert tokenizer.decode(ep.completion_ids[reply.start : reply.end]).startswith(expected_close + "\n<|im_start|>user\n")


# ------------------------------------------------------------------------------------------------
# issue 70: an <answer> inside a call's arguments; what a tool returns besides a string
# ------------------------------------------------------------------------------------------------
def submit(answer: str) -> str:
    """Submit an answer to be graded.

    Args:
        answer: the answer.
    """
    return "Correct." if answer == "<answer>25</answer>" else f"Got {answer!r}."


SUBMIT = '<reasoning>I submit.</reasoning>\n<tool>{"name": "submit", "args": {"answer": "<answer>25</answer>"}}</tool>'
SUBMIT_SCRIPT = {"Q-submit": [SUBMIT, "<reasoning>Graded.</reasoning>\n<answer>25</answer>"],
                 # what the backend returns: sampling stops at the stop string </answer>, inside the call
                 "Q-cut": [SUBMIT[: SUBMIT.index("</answer>") + len("</answer>")], "<answer>25</answer>"]}


def test_an_answer_inside_a_calls_arguments_runs_the_call(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer, [submit])
    whole, cut = env.rollout([env.prompt(q) for q in SUBMIT_SCRIPT], ScriptedPolicy(smollm2_tokenizer, SUBMIT_SCRIPT))
    assert (whole.stop_reason, whole.tool_turns, whole.tool_failures) == ("answer", 1, 0)
    assert whole.messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "submit", "arguments": {"answer": "<answer>25</answer>"}}}]
    assert whole.messages[1] == {"role": "tool", "name": "submit", "content": "Correct."}
    # cut off at the stop string: a tool turn whose call failed, saying why; the episode goes on to its answer
    assert (cut.stop_reason, cut.tool_turns, cut.tool_failures) == ("answer", 1, 1)
    assert cut.messages[1] == {"role": "tool", "name": "", "content": "Error: the tool call was cut off: an answer "
                               "closed inside its arguments, which ends the turn. Write the arguments without answer tags."}
    assert not whole.tokenization_mismatch and not cut.tokenization_mismatch


def lookup(query: str) -> dict:
    """Look up a city's record.

    Args:
        query: the city.
    """
    return {"city": query, "population": 1200, "capital": True, "note": "Morvane, ünd"}


def passages(query: str) -> list:
    """Passages about a city, as content blocks.

    Args:
        query: the city.
    """
    return [{"type": "text", "text": f"First about {query}."}, {"type": "text", "text": "a<|im_end|>b"}]


def grade(query: str) -> tuple:
    """Grade an answer, verl's way: (text, reward).

    Args:
        query: the answer.
    """
    return ("Correct.", 1.0) if query == "Morvane" else ("Wrong.", -0.5)


@pytest.mark.parametrize("fmt", ["xml", "chat_template"])
def test_what_a_tool_returns_reaches_the_model_the_rewards_and_the_turn_reward(smollm2_tokenizer, qwen_style_tokenizer,
                                                                                fmt):
    """A dict is its str(), as TRL shows it, a content list stays a list for the rewards (TRL's) and is its text for the model (a control
    token in it stays text), and (text, reward) shows the text and gives the reward to that tool turn."""
    from helpers import template_call, xml_call
    from mt_grpo.base.protocol import ChatTemplateProtocol
    from mt_grpo.rewards import REWARD_FUNCS
    from mt_grpo.rewards.conversation import content, failed

    tokenizer = smollm2_tokenizer if fmt == "xml" else qwen_style_tokenizer
    call = (lambda tool, q: xml_call(q, tool=tool)) if fmt == "xml" else (lambda tool, q: template_call(q, name=tool))
    script = {"Q-returns": [call("lookup", "Veltria"), call("passages", "Veltria"), call("grade", "Morvane"),
                            call("grade", "Quorvath"), "<answer>Morvane</answer>"]}
    env = make_env(tokenizer, [lookup, passages, grade], protocol=ChatTemplateProtocol() if fmt != "xml" else None,
                   max_env_steps=4, max_completion_length=1000)
    (ep,) = env.rollout([env.prompt("Q-returns")], ScriptedPolicy(tokenizer, script))
    assert (ep.stop_reason, ep.tool_turns, ep.tool_failures) == ("answer", 4, 0) and not ep.tokenization_mismatch
    assert [m for m in ep.messages if m["role"] == "tool"] == [
        {"role": "tool", "name": "lookup",
         "content": "{'city': 'Veltria', 'population': 1200, 'capital': True, 'note': 'Morvane, ünd'}"},  # TRL's str()
        {"role": "tool", "name": "passages", "content": passages("Veltria")},  # the list itself, as TRL passes it
        {"role": "tool", "name": "grade", "content": "Correct.", "reward": 1.0},
        {"role": "tool", "name": "grade", "content": "Wrong.", "reward": -0.5}]
    listed = ep.messages[3]
    assert content(listed) == "First about Veltria.\na<|im_end|>b" and not failed(listed)
    replies = [tokenizer.decode(ep.completion_ids[s.start : s.end]) for s in ep.spans if s.role == "env"]
    assert "First about Veltria.\na<|im_end|>b" in replies[1]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply_ids = [ep.completion_ids[s.start : s.end] for s in ep.spans if s.role == "env"]
    assert reply_ids[1].count(im_end) == reply_ids[0].count(im_end)  # the tool's <|im_end|> is text, not a turn's end
    assert REWARD_FUNCS["tool_rewards"]([None], [ep.messages]) == [[None, None, 1.0, -0.5]]  # no reward: no score


def test_a_call_the_budget_cut_is_not_run_and_the_difference_from_trl_is_logged(qwen_style_tokenizer, caplog,
                                                                                 monkeypatch):
    """Issue 78, point 5: a turn the completion budget cuts after a whole `<tool_call>`: the call is not run here
    (its result could not reach the model; stop reason `budget`), where TRL runs it and drops the result. Logged once;
    a turn cut by `max_tokens_per_turn` with room left is `turn_length` and logs nothing."""
    import logging

    from helpers import template_call
    from mt_grpo.base.protocol import ChatTemplateProtocol
    from mt_grpo.rollout import episodes as episode_module

    ran = []

    def search(query: str) -> str:
        """Search.

        Args:
            query: what to look for.
        """
        ran.append(query)
        return "found"

    monkeypatch.setattr(episode_module, "_BUDGET_CALL_LOGGED", [])
    call = template_call("Veltria")
    budget = len(qwen_style_tokenizer.encode(call, add_special_tokens=False)) + 4
    script = {"Q-cut": [call + " and then a long tail of words that the budget cuts off" * 4]}
    for limit, stop in ((budget, "budget"), (budget * 4, "turn_length")):
        env = make_env(qwen_style_tokenizer, [search], protocol=ChatTemplateProtocol(), max_completion_length=limit,
                       max_tokens_per_turn=min(limit, budget))
        with caplog.at_level(logging.INFO, logger="mt_grpo"):
            (ep,) = env.rollout([env.prompt("Q-cut")], ScriptedPolicy(qwen_style_tokenizer, script))
        assert ep.stop_reason == stop and ep.calls == [] and ran == []
    logged = [r for r in caplog.records if "TRL runs it and drops the result" in r.getMessage()]
    assert len(logged) == 1
