"""MultiTurnToolEnv on real chat templates, driven by a scripted policy: masks, spans, stopping,
budgets, and the tool-call parser."""

import time

import pytest

from mt_grpo_trainer import Action, MultiTurnToolEnv, pad_episodes, parse_action, render_ids, run_tool_calls
from scripted_policy import ScriptedPolicy

TOOL = '<tool>{"name": "search", "args": {"query": "capital of Veltria"}}</tool>'
SCRIPT = {
    "Q-search": ["<reasoning>I should look it up.</reasoning>\n" + TOOL, "<reasoning>Found it.</reasoning>\n<answer>Morvane</answer>"],
    "Q-direct": ["<reasoning>I know this.</reasoning>\n<answer>Morvane</answer>"],
    "Q-broken": ['<tool>{"name": "search", "args": {"query": "x"</tool>', '<tool>{"name": "nope", "args": {}}</tool>',
                 TOOL],  # bad JSON, unknown tool, then a call past max_env_steps=2: not run
    "Q-silent": ["I am not sure."],
}


def search(query: str) -> str:
    """Search the knowledge base."""
    return f"Veltria is a country. Its capital is Morvane. (query: {query})"


def make_env(tokenizer, **overrides):
    kwargs = dict(max_env_steps=2, max_tokens_per_turn=64, max_completion_length=400, max_tool_response_tokens=64,
                  tokenization_check="strict")
    kwargs.update(overrides)
    return MultiTurnToolEnv(tokenizer, [search], **kwargs)


@pytest.fixture(params=["smollm2", "qwen2.5"])
def tokenizer(request, smollm2_tokenizer, qwen_style_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else qwen_style_tokenizer


def test_masks_spans_and_texts_on_real_templates(tokenizer):
    env = make_env(tokenizer)
    questions = list(SCRIPT)
    episodes = env.rollout([env.prompt(q) for q in questions], ScriptedPolicy(tokenizer, SCRIPT))
    expected_stop = {"Q-search": "answer", "Q-direct": "answer", "Q-broken": "max_env_steps", "Q-silent": "no_action"}
    for q, ep in zip(questions, episodes):
        assert ep.stop_reason == expected_stop[q]
        assert len(ep.completion_ids) == len(ep.env_mask) == len(ep.sampler_logprobs)
        # spans tile the completion and alternate model / env, starting with the model
        assert ep.spans[0].start == 0 and ep.spans[-1].end == len(ep.completion_ids)
        assert all(a.end == b.start and a.role != b.role for a, b in zip(ep.spans, ep.spans[1:]))
        model_turns = [s for s in ep.spans if s.role == "model"]
        # decoding only mask-1 tokens gives exactly the sampled texts, turn by turn and in all
        for span, text in zip(model_turns, SCRIPT[q]):
            assert all(ep.env_mask[span.start : span.end])
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == text
        model_ids = [t for t, m in zip(ep.completion_ids, ep.env_mask) if m]
        assert tokenizer.decode(model_ids) == "".join(SCRIPT[q][: len(model_turns)])
        # decoding mask-0 tokens gives exactly the env message wrapped in the template's turn markers
        env_msgs = [m["content"] for m in ep.messages if m["role"] == "user"]
        for span, content in zip([s for s in ep.spans if s.role == "env"], env_msgs):
            assert not any(ep.env_mask[span.start : span.end])
            assert set(ep.sampler_logprobs[span.start : span.end]) == {0.0}
            assert tokenizer.decode(ep.completion_ids[span.start : span.end]) == (
                f"<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
        # the whole thing equals a fresh render of the conversation, token for token
        assert not ep.tokenization_mismatch
        full = render_ids(tokenizer, env.prompt(q) + ep.messages)
        assert full[: len(ep.prompt_ids) + len(ep.completion_ids)] == ep.prompt_ids + ep.completion_ids


def test_tool_results_and_errors_reach_the_model(tokenizer):
    env = make_env(tokenizer)
    search_ep, _, broken_ep, _ = env.rollout([env.prompt(q) for q in SCRIPT], ScriptedPolicy(tokenizer, SCRIPT))
    assert "Its capital is Morvane" in search_ep.messages[1]["content"]
    assert (search_ep.tool_calls, search_ep.tool_failures) == (1, 0)
    errors = [m["content"] for m in broken_ep.messages if m["role"] == "user"]
    assert "not valid JSON" in errors[0] and "unknown tool 'nope'" in errors[1]
    assert all(e.startswith("<result>\nError: ") for e in errors)
    # max_env_steps=2: the third call was sampled but not run, and nothing follows it
    assert (broken_ep.tool_calls, broken_ep.tool_failures) == (2, 2)
    assert broken_ep.spans[-1].role == "model" and broken_ep.messages[-1]["content"] == TOOL


def test_live_conversations_advance_together_one_call_per_step(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer)
    policy = ScriptedPolicy(smollm2_tokenizer, SCRIPT)
    # a group of 4 identical prompts, as GRPO sends them: the first step asks for n=4 of one prompt
    env.rollout([env.prompt("Q-search")] * 4, policy)
    assert policy.calls == [(1, 4), (4, 1)]
    policy.calls.clear()
    env.rollout([env.prompt(q) for q in SCRIPT], policy)
    assert policy.calls == [(4, 1), (2, 1), (1, 1)]  # search + broken after step 1, broken after step 2


def test_turn_token_limit_truncates_the_episode(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer, max_tokens_per_turn=5)
    (ep,) = env.rollout([env.prompt("Q-direct")], ScriptedPolicy(smollm2_tokenizer, SCRIPT))
    assert ep.stop_reason == "turn_length" and ep.truncated and len(ep.completion_ids) == 5


def test_env_reply_that_does_not_fit_the_budget_ends_the_episode_without_a_partial_message(smollm2_tokenizer):
    first_turn = len(smollm2_tokenizer.encode(SCRIPT["Q-search"][0], add_special_tokens=False))
    env = make_env(smollm2_tokenizer, max_completion_length=first_turn + 10)
    (ep,) = env.rollout([env.prompt("Q-search")], ScriptedPolicy(smollm2_tokenizer, SCRIPT))
    assert ep.stop_reason == "budget" and ep.truncated
    assert [s.role for s in ep.spans] == ["model"] and all(ep.env_mask)


def test_long_tool_output_is_cut_with_a_marker(smollm2_tokenizer):
    env = make_env(smollm2_tokenizer, max_tool_response_tokens=8)
    text = env.truncate_tool_output(" ".join(["word"] * 100))  # 100 tokens
    assert text.endswith("[truncated: 8 of 100 tokens shown]")
    assert env.truncate_tool_output("short") == "short"


@pytest.mark.parametrize(
    "text, kind, detail",
    [
        ('<reasoning>r</reasoning><tool>{"name": "search", "args": {"query": "q"}}</tool>', "tool", "search"),
        ("<reasoning>r</reasoning><answer> Morvane </answer>", "answer", "Morvane"),
        ('<tool>{"name": "search", "args": {"query": "q"}</tool>', "invalid", "not valid JSON"),
        ('<tool>["search"]</tool>', "invalid", "JSON object"),
        ('<tool>{"name": "search", "args": "q"}</tool>', "invalid", '"args" must be'),
        ("<answer>x</tool>", "invalid", "unbalanced"),  # the stop string that ended it does not match the tag
        ('<tool>{"name": "search"', "invalid", "unbalanced"),
        ("<answer>never closed", "invalid", "unbalanced"),
        ("just prose", "none", ""),
        ("", "none", ""),
    ],
)
def test_parse_action(text, kind, detail):
    action = parse_action(text)
    assert action.kind == kind
    assert detail in (action.name + action.error + str(action.args.get("answer", "")))


def test_tool_calls_run_concurrently_and_a_stuck_tool_costs_only_its_timeout():
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def broken() -> str:
        raise KeyError("boom")

    tools = {"slow": slow, "broken": broken}
    calls = [Action("tool", "slow", {"seconds": 0.3}) for _ in range(4)] + [
        Action("tool", "slow", {"seconds": 60}), Action("tool", "broken"), Action("tool", "slow", {"secs": 1})]
    start = time.monotonic()
    results = run_tool_calls(tools, calls, timeout=1.0, max_workers=8)
    elapsed = time.monotonic() - start
    assert results[:4] == [("done", True)] * 4
    assert results[4] == ("Error: tool 'slow' timed out after 1s", False)
    assert results[5][0].startswith("Error: tool 'broken' raised KeyError") and not results[5][1]
    assert results[6][0].startswith("Error: bad arguments for tool 'slow'")
    assert elapsed < 5  # bounded by the timeout, not the stuck call's 60 s (generous for slow CI)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_padding_and_the_truncated_episode_setting(smollm2_tokenizer, mask_truncated):
    env = make_env(smollm2_tokenizer, max_tokens_per_turn=5)
    policy = ScriptedPolicy(smollm2_tokenizer, SCRIPT)
    truncated, done = env.rollout([env.prompt("Q-search"), env.prompt("Q-silent")], policy)
    assert truncated.truncated and not done.truncated
    batch = pad_episodes([truncated, done], smollm2_tokenizer.pad_token_id, mask_truncated)
    T = max(len(truncated.completion_ids), len(done.completion_ids))
    assert batch["completion_ids"].shape == batch["tool_mask"].shape == batch["sampler_logps"].shape == (2, T)
    assert batch["tool_mask"][1].tolist() == done.env_mask + [0] * (T - len(done.env_mask))
    assert batch["tool_mask"][0].sum().item() == (0 if mask_truncated else 5)
    assert batch["prompt_mask"][:, -1].tolist() == [1, 1]  # prompts are left-padded


def test_each_turn_asks_for_at_most_what_is_left_of_the_budget(smollm2_tokenizer):
    first = len(smollm2_tokenizer.encode(SCRIPT["Q-search"][0], add_special_tokens=False))
    env = make_env(smollm2_tokenizer, max_tokens_per_turn=64, max_completion_length=first + 60)
    seen = []

    class Recording(ScriptedPolicy):
        def generate(self, prompts, max_tokens, n=1):
            seen.append(list(max_tokens))
            return super().generate(prompts, max_tokens, n)

    (ep,) = env.rollout([env.prompt("Q-search")], Recording(smollm2_tokenizer, SCRIPT))
    env_tokens = ep.spans[1].end - ep.spans[1].start
    assert seen == [[min(64, first + 60)], [first + 60 - first - env_tokens]]


def test_model_text_is_never_evaluated():
    """Tools get parsed JSON arguments only; nothing in the trainer evaluates text."""
    hostile = '<tool>{"name": "__import__(\'os\').system(\'touch /tmp/pwned\')", "args": {"query": "__import__"}}</tool>'
    action = parse_action(hostile)
    assert action.kind == "tool" and action.args == {"query": "__import__"}
    (output, ok), = run_tool_calls({"search": search}, [action], timeout=1.0, max_workers=1)
    assert not ok and output.startswith("Error: unknown tool")
    import ast
    import inspect
    import mt_grpo_trainer

    calls = {n.func.id for n in ast.walk(ast.parse(inspect.getsource(mt_grpo_trainer)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"eval", "exec", "compile"}
