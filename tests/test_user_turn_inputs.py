"""What an environment gives as the user (user_turns.py) is data, made as a tool's output is: `respond`'s replies and a
continuation's text repaired and cut (clean_text, cut_tool_output), wrong types failing naming the class and the field;
`respond` reads a copy of the conversation; `keep_tokens` / `keep_chars` bounded to the model's last sample, counted
from the start of its message (what `respond` sees); `max_env_steps` counting tool turns only."""

import re
import time

import pytest
import user_turn_examples as examples
from scripted_policy import ScriptedPolicy
from test_environments import answer, lock_env
from test_user_turns import push, roll

from mt_grpo.base.completions import Sample
from mt_grpo.rollout.user_turns import Reply, as_reply

GUESS = {"prompt": "Guess the number.", "secret": "7"}
WORDS = "word " * 40_000  # 200k characters


class Said(ScriptedPolicy):
    """Writes the text of the first rule whose marker the conversation holds (the last rule: no marker), then, with
    `eos`, the tokenizer's end-of-turn token, as a chat model ends its turn."""

    def __init__(self, tokenizer, rules: list[tuple[str, str]], eos: bool = False):
        super().__init__(tokenizer, {})
        self.rules, self.eos = rules, eos

    def generate(self, prompts, max_tokens, n=1, params=None):
        samples = []
        for ids, limit in zip(prompts, max_tokens):
            text = self.tokenizer.decode(ids)
            said = next(out for marker, out in self.rules if not marker or marker in text)
            token_ids = self.tokenizer.encode(said, add_special_tokens=False) + [self.tokenizer.eos_token_id] * self.eos
            samples += [Sample(token_ids[:limit], [-0.5] * min(limit, len(token_ids)),
                               "stop" if len(token_ids) <= limit else "length")] * n
        return samples


def plain(messages: list[dict]) -> list[dict]:
    """The messages' role, content and tool calls (what the rewards read; the record's other keys aside)."""
    return [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} for m in messages]


def once(*replies, name: str = "Once"):
    """An environment class `name` (the warnings, once per class, name it) whose respond gives `replies` in order (a
    callable: what it returns for the messages), then None; `seen` holds what each call was given."""
    class Once(examples.Quiz):
        def reset(self, **row):
            super().reset(**row)
            self.left = list(replies)

        def respond(self, messages):
            self.seen.append(messages)
            reply = self.left.pop(0) if self.left else None
            return reply(messages) if callable(reply) else reply

    return type(name, (Once,), {})


# -- 6: respond's replies and continuation text are repaired and cut as a tool's output is -----------------------------
def test_a_long_reply_with_control_characters_is_repaired_and_cut_as_a_tool_output_is(smollm2_tokenizer, caplog):
    """200k characters, with a NUL and a lone surrogate first: the user message is the repaired text cut to
    max_tool_response_tokens (32) with cut_tool_output's marker, the model takes its next turn, and one warning per
    class names the cut and one the repair."""
    Chatty = once("a\x00b\ud800c " + WORDS, "a\x00b\ud800c " + WORDS, name="Chatty")
    env, _ = lock_env(smollm2_tokenizer, factory=Chatty, max_tool_response_tokens=32)
    (ep,) = roll(env, [GUESS], {"Guess the number.": [answer("3"), answer("5"), answer("6")]})
    assert ep.stop_reason == "answer" and ep.user_turns == 2 and [m["role"] for m in ep.messages] == \
        ["assistant", "user", "assistant", "user", "assistant"]
    reply = ep.messages[1]["content"]
    assert reply.startswith("a\ufffdb\ufffdc word word") and reply.endswith("\n[truncated: 32 tokens of 200006 "
                                                                            "characters shown]")
    assert ep.messages[3]["content"] == reply
    span = ep.spans[1]
    assert span.role == "env" and set(ep.model_mask[span.start:span.end]) == {0}
    assert reply in smollm2_tokenizer.decode(ep.completion_ids[span.start:span.end])
    assert caplog.text.count("Chatty.respond gave a reply of 200006 characters, more than max_tool_response_tokens (32)"
                             ) == 1
    assert caplog.text.count("Chatty.respond returned text with lone surrogates or control characters") == 1


def test_a_long_continuation_is_cut_as_a_tool_output_is(smollm2_tokenizer):
    """The same 200k characters as a continuation: the inserted text (mask 0) is the cut text, inside the message."""
    Long = once(Reply(WORDS, continuation=True))
    env, _ = lock_env(smollm2_tokenizer, factory=Long, max_tool_response_tokens=32)
    policy = Said(smollm2_tokenizer, [("[truncated:", " So 7.\n<answer>7</answer>"), ("", "I think\n<answer>3</answer>")])
    (ep,) = roll(env, [GUESS], {}, policy)
    assert ep.stop_reason == "answer" and [s.role for s in ep.spans] == ["model", "insert", "model"]
    inserted = smollm2_tokenizer.decode(ep.completion_ids[ep.spans[1].start:ep.spans[1].end])
    assert inserted.startswith("word word") and inserted.endswith("\n[truncated: 32 tokens of 200000 characters shown]")
    assert plain(ep.messages) == [{"role": "assistant", "content": "I think\n<answer>3</answer>" + inserted +
                            " So 7.\n<answer>7</answer>", "tool_calls": []}]
    assert set(ep.model_mask[ep.spans[1].start:ep.spans[1].end]) == {0}


def test_a_reply_longer_than_the_budget_ends_the_episode_with_a_warning(smollm2_tokenizer, caplog):
    """max_tool_response_tokens unset (the budget's 600): the cut reply cannot fit, the episode ends at the budget,
    and a warning names the class (no silent drop)."""
    env, _ = lock_env(smollm2_tokenizer, factory=once(WORDS, name="Flood"), max_tool_response_tokens=None)
    (ep,) = roll(env, [GUESS], {"Guess the number.": [answer("3"), answer("5")]})
    assert ep.stop_reason == "budget" and [m["role"] for m in ep.messages] == ["assistant"]
    assert "Flood.respond gave a reply of 200000 characters, more than max_tool_response_tokens (600)" in caplog.text
    assert "Flood.respond gave a reply that does not fit the rest of the episode's max_completion_length" in caplog.text


def test_a_10_mb_reply_costs_what_a_short_one_does(smollm2_tokenizer):
    """10 MB of reply: cut by characters before it is tokenized (cut_tool_output), so the episode takes well under a
    second's work, not a minute's."""
    env, _ = lock_env(smollm2_tokenizer, factory=once("word " * 2_000_000), max_tool_response_tokens=32)
    begun = time.monotonic()
    (ep,) = roll(env, [GUESS], {"Guess the number.": [answer("3"), answer("5")]})
    assert time.monotonic() - begun < 10  # 69 s before the cut
    assert ep.messages[1]["content"].endswith("[truncated: 32 tokens of 10000000 characters shown]")


@pytest.mark.parametrize("reply, field", [
    (Reply(content=5), r"Reply\.content = '5' \(int\); give a string"),
    (Reply(content=None), r"Reply\.content = 'None' \(NoneType\); give a string"),
    ({"content": ["a"]}, r"Reply\.content = \"\['a'\]\" \(list\); give a string"),
    (Reply("x", done="yes"), r"Reply\.done = 'yes' \(str\); give True or False"),
    (Reply("x", continuation=1), r"Reply\.continuation = '1' \(int\); give True or False"),
    (Reply("x", continuation=True, keep_tokens=-1), r"Reply\.keep_tokens = '-1' \(int\); give a count >= 0"),
    (Reply("x", continuation=True, keep_chars=-3), r"Reply\.keep_chars = '-3' \(int\); give a count >= 0"),
    (Reply("x", continuation=True, keep_chars=2.5), r"Reply\.keep_chars = '2\.5' \(float\); give a count >= 0"),
    (Reply("x", keep_tokens=2), r"Reply\.keep_tokens = '2' \(int\); give None, or continuation=True"),
    (Reply("x", continuation=True, keep_tokens=1, keep_chars=1), r"Reply\.keep_tokens and Reply\.keep_chars: give one"),
    # several messages with their roles (point 16): no assistant, one of the reply roles, text, alone
    ([{"role": "assistant", "content": "7"}], r"Reply\.messages\[0\] with the role 'assistant': only the model's "
                                              r"sampled turns are assistant messages.*as a user or system message"),
    ([{"role": "user", "content": "a"}, {"role": "judge", "content": "b"}],
     r"Reply\.messages\[1\] with the role 'judge'; give one of user, system, tool"),
    ([{"role": "system", "content": None}],
     r"Reply\.messages\[0\]\[\"content\"\] = 'None' \(NoneType\); give a string"),
    ([{"role": "user", "content": "a", "reward": 1.0}], r"Reply\.messages\[0\] with the key\(s\) \['reward'\]"),
    (["Hello"], r"Reply\.messages\[0\] = 'Hello' \(str\); give a dict"),
    (Reply(messages=[]), r"Reply\.messages = '\[\]' \(list\); give a non-empty list"),
    (Reply("x", messages=[{"role": "user", "content": "y"}]), r"Reply\.messages and Reply\.content: the messages are "
                                                             r"the whole reply"),
    (Reply(end=True, score=1.0, messages=[{"role": "user", "content": "y"}]), r"Reply\.messages and Reply\.end"),
])
def test_a_reply_field_of_the_wrong_type_fails_naming_the_class_and_the_field(reply, field):
    with pytest.raises(ValueError, match=r"^Quiz\.respond gave " + field):
        as_reply(reply, "Quiz")


def test_a_list_of_messages_is_one_reply_each_message_with_its_role_and_made_as_a_tools_output_is(smollm2_tokenizer):
    """respond returning a list: Reply(messages=...), appended as one reply after the model's turn, each message with
    its role (a tool message with its name, "" when not given), each text repaired and cut on its own, the system
    text marked as from outside (protocol.mark_outside)."""
    Hinting = once([{"role": "system", "content": "Hint: odd.\x00"}, {"role": "tool", "content": WORDS},
                    {"role": "user", "content": "Try again."}], name="Hinting")
    env, _ = lock_env(smollm2_tokenizer, factory=Hinting, max_tool_response_tokens=16)
    (ep,) = roll(env, [GUESS], {"Guess the number.": [answer("3"), answer("7")]})
    cut = ep.messages[2]["content"]
    assert ep.messages[1:4] == [{"role": "system", "content": "Hint: odd.\ufffd", "outside_text": [[0, 11]]},
                                {"role": "tool", "name": "", "content": cut}, {"role": "user", "content": "Try again."}]
    assert cut.endswith("[truncated: 16 tokens of 200000 characters shown]")
    assert [s.role for s in ep.spans] == ["model", "env", "model"] and ep.user_turns == 1
    span = ep.spans[1]
    assert set(ep.model_mask[span.start:span.end]) == {0}
    assert ep.completion_ids[span.start:span.end] == env.env_reply_ids(ep.messages[1:4])


def test_a_wrong_reply_stops_the_rollout_naming_the_class_the_field_and_the_row(smollm2_tokenizer):
    env, _ = lock_env(smollm2_tokenizer, factory=once(Reply(content=None)))
    with pytest.raises(ValueError, match=r"^Once\.respond gave Reply\.content = 'None' \(NoneType\); .*\(the batch's row 0 "
                                         r"\(secret='7'\)\)$"):
        roll(env, [GUESS], {"Guess the number.": [answer("3")]})


def test_a_long_verifiers_env_response_is_cut(smollm2_tokenizer, tmp_path, monkeypatch, caplog):
    """A classic verifiers MultiTurnEnv whose env_response is 200k characters: the user message is cut (64 tokens)."""
    import os
    from types import SimpleNamespace

    from helpers import make_env

    from mt_grpo.adapters.verifiers import adapt
    from mt_grpo.base.protocol import XMLProtocol
    from mt_grpo.compat import provide
    from mt_grpo.rollout.environments import EnvironmentPool

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    provide("verifiers")
    (tmp_path / "vf_verbose.py").write_text('''
from datasets import Dataset
import verifiers as vf

class VerboseEnv(vf.MultiTurnEnv):
    async def is_completed(self, messages, state, **kwargs):
        return len([m for m in messages if m["role"] == "assistant"]) >= 2

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "word " * 40000}], state

def said_something(completion, **kwargs) -> float:
    return 1.0

def load_environment():
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Say a word."}], "answer": ""}])
    return VerboseEnv(dataset=dataset, rubric=vf.Rubric(funcs=[said_something]), max_turns=5)
''')
    parts = adapt(SimpleNamespace(verifiers_env=str(tmp_path / "vf_verbose.py"), verifiers_env_args=None))
    pool = EnvironmentPool(parts.environment_factory, [], XMLProtocol())
    env = make_env(smollm2_tokenizer, pool.all_tools(), environments=pool, task_prompt=None, examples=None,
                   max_completion_length=800, max_tokens_per_turn=96, max_tool_response_tokens=64, **parts.settings)
    rows = [dict(parts.train_dataset[0])]
    (ep,) = env.rollout([env.prompt(rows[0]["prompt"])], ScriptedPolicy(smollm2_tokenizer, {
        "Say a word.": [answer("hi"), answer("ho")]}), rows=rows)
    assert [m["role"] for m in ep.messages] == ["assistant", "user", "assistant"]
    assert ep.messages[1]["content"].endswith("\n[truncated: 64 tokens of 200000 characters shown]")
    assert re.search(r"\w+\.respond gave a reply of 200000 characters", caplog.text)


# -- 7: respond reads a copy --------------------------------------------------------------------------------------------
def test_respond_editing_the_conversation_in_place_changes_nothing_the_rewards_read(smollm2_tokenizer):
    def rewrite(messages):
        messages[-1]["content"] = "REWRITTEN BY RESPOND"
        messages[-1]["tool_calls"].append({"name": "forged"})
        messages[0]["content"] = "SYSTEM REWRITTEN"
        messages.append({"role": "user", "content": "an extra message"})
        return "Try again."

    env, _ = lock_env(smollm2_tokenizer, factory=once(rewrite, None))
    (ep,) = roll(env, [GUESS], {"Guess the number.": [answer("3"), answer("5")]})
    assert plain(ep.messages) == [{"role": "assistant", "content": answer("3"), "tool_calls": []},
                           {"role": "user", "content": "Try again."},
                           {"role": "assistant", "content": answer("5"), "tool_calls": []}]
    assert ep.prompt_messages[0]["content"] != "SYSTEM REWRITTEN"
    first = ep.spans[0]
    assert smollm2_tokenizer.decode(ep.completion_ids[first.start:first.end]) == ep.messages[0]["content"]
    seen = ep.toolset.environment.seen
    assert seen[1][-3]["content"] == answer("3") and seen[1][0]["content"] != "SYSTEM REWRITTEN"
    assert not ep.tokenization_mismatch


# -- 8: keep_tokens / keep_chars are bounded to the sample and count from the message's start ---------------------------
FIRST, TIPPED, SURE = "I think\n<answer>3</answer>", " it is 7.\n<answer>7</answer>", " Yes.\n<answer>7</answer>"


def said(tokenizer):
    return Said(tokenizer, [(" Sure?", SURE), ("But wait,", TIPPED), ("", FIRST)], eos=True)


@pytest.mark.parametrize("keep", [{"keep_tokens": 10**6}, {"keep_chars": 10**6}, {}])
def test_keeping_past_the_sample_keeps_all_of_it_but_its_end_of_turn_token(smollm2_tokenizer, keep):
    """The model ends its sample with <|im_end|>; a continuation keeping more than the sample keeps every sampled token
    but that one, which would train as a token inside the open message."""
    env, _ = lock_env(smollm2_tokenizer, factory=once(Reply(" But wait,", continuation=True, **keep)))
    (ep,) = roll(env, [GUESS], {}, said(smollm2_tokenizer))
    eos = smollm2_tokenizer.eos_token_id
    first, tip, second = ep.spans
    assert ep.completion_ids[first.start:first.end] == smollm2_tokenizer.encode(FIRST, add_special_tokens=False)
    assert ep.completion_ids.count(eos) == 1 and ep.completion_ids[-1] == eos  # only the message's own end
    assert ep.model_mask == [1] * first.end + [0] * (tip.end - tip.start) + [1] * (second.end - second.start)
    assert ep.messages[0]["content"] == FIRST + " But wait," + TIPPED


def test_keep_chars_counts_the_whole_message_as_respond_sees_it_on_a_second_continuation(smollm2_tokenizer):
    """Two continuations, each cutting at `content.index("<answer>")` of the message respond sees: the second cut
    lands before the second sample's <answer>, in the text that sample wrote."""
    cut = lambda text: lambda messages: Reply(text, continuation=True,  # noqa: E731
                                              keep_chars=messages[-1]["content"].index("<answer>"))
    env, _ = lock_env(smollm2_tokenizer, factory=once(cut(" But wait,"), cut(" Sure?")))
    (ep,) = roll(env, [GUESS], {}, said(smollm2_tokenizer))
    assert [s.role for s in ep.spans] == ["model", "insert", "model", "insert", "model"]
    decode = lambda s: smollm2_tokenizer.decode(ep.completion_ids[s.start:s.end])  # noqa: E731
    assert [decode(s) for s in ep.spans] == ["I think\n", " But wait,", " it is 7.\n", " Sure?", SURE + "<|im_end|>"]
    assert plain(ep.messages) == [{"role": "assistant", "content": "I think\n But wait, it is 7.\n Sure?" + SURE,
                            "tool_calls": []}]
    seen = ep.toolset.environment.seen
    assert seen[1][-1]["content"] == "I think\n But wait," + TIPPED  # what the second keep_chars counted
    assert not ep.tokenization_mismatch


def test_keep_tokens_counts_from_the_message_start_and_may_not_cut_before_the_last_sample(smollm2_tokenizer):
    """keep_tokens counts the message's tokens (its first sample, the inserted text, then the last sample): on a second
    continuation, keeping the tokens before the last sample and 3 of it keeps those 3; fewer than the fixed part fails
    naming the field and the count."""
    tok = smollm2_tokenizer
    fixed = len(tok.encode("I think\n", add_special_tokens=False)) + len(tok.encode(" But wait,", add_special_tokens=False))
    first = Reply(" But wait,", continuation=True, keep_chars=len("I think\n"))
    env, _ = lock_env(tok, factory=once(first, Reply(" Sure?", continuation=True, keep_tokens=fixed + 3)))
    (ep,) = roll(env, [GUESS], {}, said(tok))
    last = ep.spans[2]
    assert ep.completion_ids[last.start:last.end] == tok.encode(TIPPED, add_special_tokens=False)[:3]
    env, _ = lock_env(tok, factory=once(first, Reply(" Sure?", continuation=True, keep_tokens=1)))
    with pytest.raises(ValueError, match=rf"Once\.respond gave Reply\.keep_tokens = 1, which cuts the model's message "
                                         rf"before its last sample: its first {fixed} tokens .* give at least {fixed}"):
        roll(env, [GUESS], {}, said(tok))


def test_a_negative_keep_fails_naming_the_field(smollm2_tokenizer):
    env, _ = lock_env(smollm2_tokenizer, factory=once(Reply(" But wait,", continuation=True, keep_chars=-1)))
    with pytest.raises(ValueError, match=r"Once\.respond gave Reply\.keep_chars = '-1' \(int\); give a count >= 0"):
        roll(env, [GUESS], {}, said(smollm2_tokenizer))


# -- 19: max_env_steps counts tool turns only ---------------------------------------------------------------------------
@pytest.mark.parametrize("continuation", [True, False])
def test_max_env_steps_counts_tool_turns_not_continuations_or_user_turns(smollm2_tokenizer, continuation):
    """max_env_steps 1 after a reply as the user (a continuation, or a user message): one push runs, the second is
    not run (stop_reason max_env_steps)."""
    class Coach(examples.Door):
        def respond(self, messages):
            if self.pushes:
                return None
            return Reply(" Let me push." if continuation else "Push it.", continuation=continuation)

    env, _ = lock_env(smollm2_tokenizer, factory=Coach)
    env.max_env_steps = 1
    policy = Said(smollm2_tokenizer, [("Let me push.", push()), ("Push it.", push()), ("", answer("3"))])
    (ep,) = roll(env, [{"prompt": "Open the door."}], {}, policy)
    assert ep.stop_reason == "max_env_steps" and ep.toolset.environment.pushes == 1 and len(ep.calls) == 1
    assert ep.user_turns == 1 and [m["role"] for m in ep.messages].count("tool") == 1
